"""What the connector's layer-by-layer restore in the step changes for the forward pass that
reads it, on this host.

A restore in the step (``load_mode=sync``, or ``auto`` when short) is read by the forward
pass that schedules it: vLLM calls ``wait_for_layer_load(layer)`` before each attention layer.
The connector writes each layer of each chunk into vLLM's blocks as soon as it is verified,
so with object format 3 (a BLAKE3 per layer) the pass starts layer 0 while later layers are
still being read; with format 2 (one digest over the whole object) no layer is written before
its chunk's last byte is in, which is what the connector did for every format before.

The connector's own worker side (no vLLM) restores 8 chunks of SmolLM2-135M's shape (30
layers, 3 KV heads, head size 64, bfloat16, 256 tokens: 5.9 MB each) from a ``file://``
store into caches in vLLM 0.32's CPU layout, while a stand-in forward pass waits for each
layer and then computes about what SmolLM2 computes per layer for ``--tail`` new tokens (one
matrix product of the layer's 3.5 M weights). Reported per format, median of interleaved
runs: when layer 0 may start, and when the pass ends; and the pass alone, with nothing to
restore.

    python scripts/bench/bench_vllm_layer_pipeline.py [--runs 15] [--tail 128] [--chunks 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from kvcloud import KVCloud, Namespace
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.layout import learn_layout
from kvcloud.integrations.vllm.specs import LoadChunk, LoadSpec
from kvcloud.integrations.vllm.worker import WorkerSide
from tests.unit.test_vllm_layout import cpu_write, layer_for

LAYERS, HEADS, DIM, CHUNK, BLOCK = 30, 3, 64, 256, 16
HIDDEN, LAYER_PARAMS = 576, 3_500_000  # SmolLM2-135M: width, weights per decoder layer


def _namespace() -> Namespace:
    return Namespace(
        model="bench/layer-pipeline", revision="r1", num_layers=LAYERS, num_kv_heads=HEADS,
        head_dim=DIM, dtype="bfloat16", chunk_tokens=CHUNK,
    )  # fmt: skip


def _worker(kv: KVCloud, ns: Namespace, n_blocks: int) -> WorkerSide:
    cfg = VLLMConnectorConfig(write_policy="off", load_mode="sync", load_timeout=30.0)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    ws = WorkerSide(cfg, ns, kv, vllm_config, SimpleNamespace(num_blocks=n_blocks))
    write = layer_for(cpu_write)
    probe = torch.zeros(n_blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    layout = learn_layout(write, probe, n_blocks, BLOCK, HEADS, DIM)
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        ws.caches[name] = torch.zeros_like(probe)
        ws.layer_index[name], ws.layouts[name] = layer, layout
    return ws


def _spec(kv: KVCloud, ns: Namespace, tokens: np.ndarray, tenant: str, run: int) -> LoadSpec:
    m = kv.lookup(ns, tokens, tenant=tenant)
    per = CHUNK // BLOCK
    chunks = [
        LoadChunk(
            ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size,
            list(range(1 + i * per, 1 + (i + 1) * per)),
        )
        for i, ref in enumerate(m.chunks)
    ]  # fmt: skip
    return LoadSpec(f"{tenant}-{run}", tenant, chunks, sync=True)


def _pass(ws: WorkerSide | None, weights: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """A stand-in forward pass: per layer, wait for it (when restoring), then compute. Returns
    seconds until layer 0 could start and until the pass ended, from its start."""
    start = time.perf_counter()
    first = 0.0
    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    for layer, name in enumerate(names):
        if ws is not None:
            ws.wait_for_layer_load(name)
        if layer == 0:
            first = time.perf_counter() - start
        torch.mm(x, weights)
    return first, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--tail", type=int, default=128, help="new tokens the pass computes")
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    ns = _namespace()
    n = args.chunks
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=n * CHUNK, dtype=np.int64)
    arr = rng.integers(0, 1 << 16, size=ns.kv_shape(n * CHUNK), dtype=np.uint16) & 0x7F7F
    x = torch.randn(args.tail, HIDDEN, dtype=torch.bfloat16)
    weights = torch.randn(HIDDEN, LAYER_PARAMS // HIDDEN, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        index = f"sqlite://{tmp}/index.db"
        kvs = {
            v: KVCloud.open(store=f"file://{tmp}/o", index=index, segment_version=v) for v in (2, 3)
        }
        for v, kv in kvs.items():
            kv.push(ns, tokens, arr, tenant=f"v{v}")
        workers = {v: _worker(kvs[v], ns, 1 + n * CHUNK // BLOCK) for v in (2, 3)}
        times: dict[str, list[tuple[float, float]]] = {"2": [], "3": [], "none": []}
        for run in range(args.runs + 2):  # the first two warm caches and pools
            for v in ("2", "3", "none"):  # interleaved, so drift hits all alike
                ws = workers.get(int(v)) if v != "none" else None
                if ws is not None:
                    spec = _spec(kvs[int(v)], ns, tokens, f"v{v}", run)
                    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
                got = _pass(ws, weights, x)
                if ws is not None:
                    ws.get_finished(set())
                    assert not ws.get_block_ids_with_load_errors()
                if run >= 2:
                    times[v].append(got)
        for ws in workers.values():
            ws.shutdown()
    mb = ns.bytes_per_token * CHUNK / 1e6
    print(f"{n} chunks x {mb:.1f} MB restored in the step, pass of {LAYERS} layers x "
          f"{args.tail} new tokens; {args.runs} runs, median ms")  # fmt: skip
    print(f"{'restore':<38}{'layer 0 starts':>16}{'pass ends':>12}")
    labels = {
        "none": "none (the pass alone)",
        "2": "format 2 (whole-object digest)",
        "3": "format 3 (per-layer, streamed)",
    }
    med = {v: [statistics.median(t[i] for t in times[v]) for i in (0, 1)] for v in times}
    for v in ("none", "2", "3"):
        print(f"{labels[v]:<38}{1e3 * med[v][0]:>16.1f}{1e3 * med[v][1]:>12.1f}")
    print(f"{'format 3 / format 2':<38}{med['3'][0] / med['2'][0]:>15.2f}x"
          f"{med['3'][1] / med['2'][1]:>11.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
