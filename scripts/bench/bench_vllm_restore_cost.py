"""What a moved turn's restore costs the connector itself, apart from vLLM's scheduling.

The connector's worker side (``WorkerSide``) restores chunks of SmolLM2-135M's shape from a
``file://`` store into a cache laid out as vLLM's CPU backend lays it out, the whole process
bound to one core as each server is in ``make bench-vllm-load``: once on an idle core and
once beside a thread running a forward-like loop of small torch ops (what a decoding engine
does on that core). The time is from ``start_load_kv`` to ``get_finished`` reporting it:
pull, BLAKE3 verification and the writes into the blocks.

    python scripts/bench/bench_vllm_restore_cost.py --chunks 1 2 4 --runs 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from kvcloud import KVCloud, Namespace
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.layout import learn_layout
from kvcloud.integrations.vllm.specs import LoadChunk, LoadSpec
from kvcloud.integrations.vllm.worker import WorkerSide
from tests.unit.test_vllm_layout import cpu_write, layer_for  # vLLM CPU's cache write

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 128  # SmolLM2-135M, the bench's block size


def setup(work: Path, max_chunks: int, sets: int) -> tuple[WorkerSide, list[list[LoadChunk]]]:
    ns = Namespace(
        model="bench", revision="r", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
        dtype="float32", chunk_tokens=BLOCK,
    )  # fmt: skip
    kvc = KVCloud.open(store=f"file://{work}/o", index=f"sqlite://{work}/i.db", secret="b")
    blocks = max_chunks * sets
    ws = WorkerSide(
        VLLMConnectorConfig(write_policy="off"),
        ns,
        kvc,
        SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK)),
        SimpleNamespace(num_blocks=blocks),
    )
    op = layer_for(cpu_write)
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        cache = torch.zeros(blocks, HEADS, BLOCK, 2 * DIM)
        ws.caches[name], ws.layer_index[name] = cache, layer
        ws.layouts[name] = learn_layout(op, cache, blocks, BLOCK, HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    chunk_sets = []
    for s in range(sets):
        tokens = torch.randint(0, 50_000, (max_chunks * BLOCK,), generator=g).numpy()
        kv = torch.randn(*ns.kv_shape(len(tokens)), generator=g).numpy()
        kvc.push(ns, tokens, kv)
        m = kvc.lookup(ns, tokens)
        chunk_sets.append(
            [
                LoadChunk(
                    r.position,
                    r.fp,
                    r.parent,
                    r.entry.object_key,
                    r.entry.size,
                    [s * max_chunks + i],
                )
                for i, r in enumerate(m.chunks)
            ]
        )
    return ws, chunk_sets


def restore_ms(ws: WorkerSide, chunks: list[LoadChunk], n: int, req: str) -> float:
    spec = LoadSpec(req, "default", chunks[:n])
    t0 = time.perf_counter()
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    while not (ws.get_finished(set())[1] or set()) & {req}:
        time.sleep(0.0005)
    if ws.get_block_ids_with_load_errors():
        raise RuntimeError("a restore failed")
    return 1e3 * (time.perf_counter() - t0)


def forward_loop(stop: threading.Event) -> None:
    """A decode-like load: per layer a few small ops with Python between them."""
    x, w = torch.randn(3, 576), torch.randn(576, 576)
    while not stop.is_set():
        for _ in range(LAYERS):
            y = torch.nn.functional.silu(x @ w)
            x = (y * 0.5 + x) / (x.norm() + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    sets = 6
    ws, chunk_sets = setup(Path(tempfile.mkdtemp(prefix="kvcloud-rcost-")), max(args.chunks), sets)
    k = 0
    results: dict[tuple[str, int], list[float]] = {}
    for load in ("idle core", "beside a forward loop"):
        stop = threading.Event()
        th = threading.Thread(target=forward_loop, args=(stop,), daemon=True)
        if load != "idle core":
            th.start()
            time.sleep(0.2)
        for n in args.chunks:
            for _ in range(2):  # warm: the pages of the objects and the staging buffer
                k += 1
                restore_ms(ws, chunk_sets[k % sets], n, f"w{k}")
            times = []
            for _ in range(args.runs):
                k += 1
                times.append(restore_ms(ws, chunk_sets[k % sets], n, f"r{k}"))
            results[(load, n)] = times
        stop.set()
        if th.is_alive():
            th.join()
    ws.shutdown()
    ws._pool.shutdown(wait=True)  # no load thread left when the interpreter exits
    chunk_mb = LAYERS * 2 * BLOCK * HEADS * DIM * 4 / 1e6
    print(
        f"restore of n chunks of {chunk_mb:.1f} MB (SmolLM2-135M fp32, 128 tokens), "
        f"start_load_kv to get_finished, one core, median / p90 of {args.runs} (ms):"
    )
    print("\n| chunks | MB | idle core | beside a forward loop |\n|---:|---:|---:|---:|")
    for n in args.chunks:
        cells = []
        for load in ("idle core", "beside a forward loop"):
            t = sorted(results[(load, n)])
            cells.append(f"{statistics.median(t):.1f} / {t[int(0.9 * (len(t) - 1))]:.1f}")
        print(f"| {n} | {n * chunk_mb:.1f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
