"""What verified layer-wise streaming (object format 3) changes for a restore, on this host.

A restore pulls chunks and writes each into the engine's KV cache. With format 2 an object
is verified by one digest over all of it, so no layer may be written before its last byte
is in; with format 3 the key addresses the header and the header's table each layer, so
layer l is written while layer l + 1 is still in flight (``KVCloud.pull_into``'s
``on_layer``). Both runs below do the same work — pull 8 chunks of SmolLM2-135M's shape
(30 layers, 3 KV heads, head size 64, bfloat16, 256 tokens: 5.9 MB each) from the store,
verify them, and write every layer into a torch cache in vLLM's CPU layout with the vLLM
connector's own block writes (a layout learned through the CPU backend's write op, one
``index_copy_`` per chunk and layer over its blocks) — and differ only in the object format,
so the ratios are what streaming saves: the time until the first layer is usable, and the
whole restore.

    python scripts/bench/bench_layer_streaming.py [--store URL] [--chunks 8] [--runs 15]

The default store is ``file://`` in a temporary folder (page cache: the bytes come at memory
speed, so this measures hashing and copying, not a network).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from kvcloud import KVCloud, Namespace
from kvcloud.integrations.vllm.layout import block_index, learn_layout
from tests.unit.test_vllm_layout import cpu_write, layer_for

LAYERS, HEADS, DIM, CHUNK, BLOCK = 30, 3, 64, 256, 16


def _namespace() -> Namespace:
    return Namespace(
        model="bench/layer-streaming",
        revision="r1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype="bfloat16",
        chunk_tokens=CHUNK,
    )


def _restore(kv: KVCloud, ns: Namespace, tokens: np.ndarray, tenant: str, n: int) -> dict:
    """One restore of ``n`` chunks into a fresh cache: seconds to the first usable layer and
    to the end (pull, verify and every layer written)."""
    per_chunk = CHUNK // BLOCK
    # vLLM 0.32's CPU cache per layer: [blocks, heads, block, 2·dim], K transposed in a block
    cache = torch.zeros(LAYERS, n * per_chunk, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    layout = learn_layout(layer_for(cpu_write), cache[0], n * per_chunk, BLOCK, HEADS, DIM)
    ids = [block_index(range(i * per_chunk, (i + 1) * per_chunk), cache.device) for i in range(n)]
    staging = torch.empty(n, LAYERS, 2, CHUNK, HEADS, DIM, dtype=torch.bfloat16)
    dests = [t.view(torch.int16).numpy().view("<u2") for t in staging]
    first: list[float] = []
    lock = threading.Lock()

    def write(i: int, layer: int) -> None:
        layout.scatter(cache[layer], ids[i], staging[i, layer])  # [2, CHUNK, heads, dim]
        if not first:
            with lock:
                first.append(time.perf_counter())

    m = kv.lookup(ns, tokens, tenant=tenant)
    assert len(m.chunks) == n, (len(m.chunks), n)
    start = time.perf_counter()
    res = kv.pull_into(m, dests, on_layer=write)
    end = time.perf_counter()
    assert res.chunks == n
    return {"first": first[0] - start, "total": end - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="store URL (default: file:// in a temporary folder)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ns = _namespace()
    n = args.chunks
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=n * CHUNK, dtype=np.int64)
    arr = rng.integers(0, 1 << 16, size=ns.kv_shape(n * CHUNK), dtype=np.uint16)
    arr &= 0x7F7F  # finite bfloat16 values
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"file://{tmp}/objects"
        index = f"sqlite://{tmp}/index.db"
        kvs = {
            v: KVCloud.open(store=store, index=index, segment_version=v, max_connections=4)
            for v in (2, 3)
        }
        for v, kv in kvs.items():
            kv.push(ns, tokens, arr, tenant=f"v{v}")
        for _ in range(2):  # warm: page cache, connections, thread pools
            for v in (2, 3):
                _restore(kvs[v], ns, tokens, f"v{v}", n)
        times: dict[int, list[dict]] = {2: [], 3: []}
        for _ in range(args.runs):
            for v in (2, 3):  # interleaved, so drift hits both alike
                times[v].append(_restore(kvs[v], ns, tokens, f"v{v}", n))
        for kv in kvs.values():
            kv.close()
    size_mb = n * ns.bytes_per_token * CHUNK / 1e6
    print(f"{n} chunks x {ns.bytes_per_token * CHUNK / 1e6:.1f} MB ({size_mb:.0f} MB), "
          f"{args.runs} runs each, median ms (store: {args.store or 'file:// tmp'})")  # fmt: skip
    print(f"{'format':<34}{'first layer usable':>20}{'restore done':>16}")
    med = {v: {k: statistics.median(t[k] for t in times[v]) for k in ("first", "total")}
           for v in (2, 3)}  # fmt: skip
    labels = {2: "2 (whole-object digest)", 3: "3 (per-layer digests, streamed)"}
    for v in (2, 3):
        print(f"{labels[v]:<34}{1e3 * med[v]['first']:>20.1f}{1e3 * med[v]['total']:>16.1f}")
    print(f"{'format 3 / format 2':<34}{med[3]['first'] / med[2]['first']:>19.2f}x"
          f"{med[3]['total'] / med[2]['total']:>15.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
