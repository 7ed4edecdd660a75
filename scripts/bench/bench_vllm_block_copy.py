"""What writing a restore into vLLM's blocks (and reading a save out of them) costs, per
copy strategy: the connector's one ``index_copy_`` / ``index_select`` per layer over the
block ids, against one strided copy per run of consecutive blocks (what it did before).

SmolLM2-135M's shape (30 layers, 3 KV heads, head size 64), 2,048 tokens (8 chunks of 256),
in the physical layouts of vLLM 0.32's CPU backend (LBHNC, K transposed inside a block) and
of FlashAttention/FlashInfer (LBNHC), with the blocks allocated in order (one run per chunk)
or scattered (every block its own run, as after a busy server's frees). Runs on CUDA tensors
too where torch sees a GPU (``--device cuda``).

    python scripts/bench/bench_vllm_block_copy.py [--device cpu] [--dtype float32] [--runs 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from kvcloud.integrations.vllm.layout import BlockLayout, block_index, learn_layout, runs
from tests.unit.test_vllm_layout import cpu_split_write, layer_for, split_write

LAYERS, HEADS, DIM = 30, 3, 64
CHUNK, CHUNKS = 256, 8
# physical order of the (L, B, H, N, C) buffer, and the backend's cache-write op
LAYOUTS = {
    "cpu (LBHNC)": ((0, 1, 2, 3, 4), cpu_split_write),
    "flash (LBNHC)": ((0, 1, 3, 2, 4), split_write),
}


def scatter_runs(
    layout: BlockLayout, cache: torch.Tensor, ids: list[int], kv: torch.Tensor
) -> None:
    """The former way: one strided copy per run of consecutive blocks, K and V apart."""
    n, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    src = kv.to(cache.device).reshape(2, len(ids), n, h, d)
    for half in (0, 1):
        view = layout._half_view(cache, half)
        for start, lo, hi in runs(ids):
            view[lo:hi].copy_(src[half, start : start + hi - lo])


def gather_runs(
    layout: BlockLayout, cache: torch.Tensor, ids: list[int], out: torch.Tensor
) -> None:
    n, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    dst = out.view(2, len(ids), n, h, d)
    for half in (0, 1):
        view = layout._half_view(cache, half)
        for start, lo, hi in runs(ids):
            dst[half, start : start + hi - lo].copy_(view[lo:hi])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], runs: int, device: str) -> str:
    fn()  # warm
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return f"{statistics.median(times):.1f} / {times[int(0.9 * (len(times) - 1))]:.1f}"


def case(
    layout: BlockLayout,
    buf: torch.Tensor,
    caches: torch.Tensor,
    staging: torch.Tensor,
    chunk_ids: list[list[int]],
    runs: int,
    device: str,
) -> list[str]:
    """Restore and save every layer of the chunks both ways; check both write the same."""
    tensors = [block_index(c, torch.device(device)) for c in chunk_ids]
    outs = [torch.empty_like(staging[0]) for _ in chunk_ids]

    def restore_runs() -> None:
        for layer in range(LAYERS):
            for i, c in enumerate(chunk_ids):
                scatter_runs(layout, caches[layer], c, staging[i, layer])

    def restore_batched() -> None:
        for layer in range(LAYERS):
            for i, t in enumerate(tensors):
                layout.scatter(caches[layer], t, staging[i, layer])

    def save_runs() -> None:
        for layer in range(LAYERS):
            for i, c in enumerate(chunk_ids):
                gather_runs(layout, caches[layer], c, outs[i][layer])

    def save_batched() -> None:
        for layer in range(LAYERS):
            for i, t in enumerate(tensors):
                layout.gather_into(caches[layer], t, outs[i][layer])

    cells = [timed(fn, runs, device) for fn in (restore_runs, restore_batched)]
    buf.zero_()
    restore_runs()
    before = buf.clone()
    buf.zero_()
    restore_batched()
    if not torch.equal(before, buf):
        raise SystemExit("the two ways wrote different bytes")
    cells += [timed(fn, runs, device) for fn in (save_runs, save_batched)]
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    dev = args.device
    print(
        f"{CHUNKS} chunks of {CHUNK} tokens, {LAYERS} layers x {HEADS} KV heads x {DIM}, "
        f"{args.dtype}, on {dev} ({torch.get_num_threads()} thread); median / p90 of "
        f"{args.runs} (ms, every layer)\n"
    )
    print(
        "| layout | block | blocks | restore: per run | restore: batched "
        "| save: per run | save: batched |\n|---|---:|---|---:|---:|---:|---:|"
    )
    rng = random.Random(0)
    for name, (order, write) in LAYOUTS.items():
        for bs in args.block_sizes:
            per_chunk = CHUNK // bs
            nb = 2 * CHUNKS * per_chunk + 1
            logical = (LAYERS, nb, HEADS, bs, 2 * DIM)
            buf = torch.zeros(tuple(logical[i] for i in order), dtype=dtype, device=dev)
            caches = buf.permute(*[order.index(i) for i in range(5)])
            layout = learn_layout(layer_for(write), caches[0], nb, bs, HEADS, DIM)
            # host staging as restores pull it: [chunks, layers, 2, chunk, heads, dim]
            staging = torch.randn(CHUNKS, LAYERS, 2, CHUNK, HEADS, DIM).to(dtype)
            in_order = list(range(1, 1 + CHUNKS * per_chunk))
            scattered = rng.sample(range(1, nb), CHUNKS * per_chunk)
            for label, ids in (("in order", in_order), ("scattered", scattered)):
                chunk_ids = [ids[i * per_chunk : (i + 1) * per_chunk] for i in range(CHUNKS)]
                cells = case(layout, buf, caches, staging, chunk_ids, args.runs, dev)
                print(f"| {name} | {bs} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
