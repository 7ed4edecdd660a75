"""Restore against recompute on one GPU: a Llama-3.1-8B-shaped model (random weights,
transformers on CUDA; the device machine has PyTorch and transformers, not vLLM) at 4k, 16k
and 32k tokens, from ``file://`` and from a local S3 server (moto_server).

Per length: the prefill (``model(input_ids, use_cache=True)``, timed to
``torch.cuda.synchronize()``; one warm-up pass first) against a restore of the same prompt's
KV: index lookup, every chunk pulled and verified (BLAKE3 per layer) into pinned host
staging, copied to the GPU with ``non_blocking`` copies, and synchronized: the KV usable on
the device. The restored KV is checked bit for bit against what the prefill produced.

    python scripts/bench/bench_gpu_restore.py                      # CUDA, Llama-3.1-8B shape
    python scripts/bench/bench_gpu_restore.py --shape tiny --tokens 1024,2048   # anywhere (CPU)

Prints a markdown table; ``--out`` writes JSON. Under 10 minutes on one H100 (the 32k
prefill of an 8B model is about 1.5 s there; its KV is 4 GiB in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvcloud import KVCloud, Namespace

SHAPES = {
    # Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads of 128, hidden 4096, MLP 14336
    "llama-3.1-8b": dict(
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_size=4096, intermediate_size=14336, vocab_size=128256,
    ),
    "tiny": dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        hidden_size=128, intermediate_size=256, vocab_size=1024,
    ),
}  # fmt: skip


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=40_000, rope_theta=500_000.0)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def prefill(model: Any, ids: torch.Tensor, device: torch.device) -> tuple[float, np.ndarray]:
    """Seconds of one prefill, and its KV as kvcloud's ``[layers, 2, tokens, heads, dim]``."""
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True)
    sync(device)
    seconds = time.perf_counter() - t0
    cache = out.past_key_values
    layers = []
    for layer in range(len(cache.layers) if hasattr(cache, "layers") else len(cache)):
        k, v = (
            (cache.layers[layer].keys, cache.layers[layer].values)
            if hasattr(cache, "layers")
            else cache[layer]
        )
        layers.append(torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]))
    kv = torch.stack(layers).contiguous().cpu()
    return seconds, to_numpy(kv)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def restore(
    kvc: KVCloud, ns: Namespace, tokens: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[float, torch.Tensor]:
    """Seconds until the stored KV of ``tokens`` is on ``device``: lookup, pull and verify
    into pinned staging, asynchronous copies, synchronize."""
    c = ns.chunk_tokens
    pinned = device.type == "cuda"
    t0 = time.perf_counter()
    m = kvc.lookup(ns, tokens)
    n = len(m.chunks)
    staging = [
        torch.empty(ns.kv_shape(c), dtype=dtype, pin_memory=pinned) for _ in range(n)
    ]  # (allocated inside the timing: a server keeps its ring, so this is the worst case)
    result = kvc.pull_into(m, [to_numpy(s) for s in staging])
    if result.chunks != n:
        raise RuntimeError(f"{n - result.chunks} chunks failed to restore: {result.failures}")
    out = torch.empty((ns.num_layers, 2, n * c, ns.num_kv_heads, ns.head_dim), dtype=dtype,
                      device=device)  # fmt: skip
    for i, s in enumerate(staging):
        out[:, :, i * c : (i + 1) * c].copy_(s, non_blocking=pinned)
    sync(device)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stores", default="file,s3", help="file, s3 or both")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(a.shape, device, dtype)
    cfg = model.config
    ns = Namespace(
        model=f"bench/{a.shape}", num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        revision="random-seed-0", dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        chunk_tokens=a.chunk,
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="kvcloud-gpu-bench-"))
    stores: dict[str, str] = {}
    moto = None
    if "file" in a.stores:
        stores["file"] = f"file://{work}/objects"
    if "s3" in a.stores:
        from tests.servers import s3_env, start_moto

        moto = start_moto(work / "moto")
        os.environ.update(s3_env(moto.endpoint))  # this process is the S3 client
        stores["s3"] = (
            f"s3://kvcloud/gpu?endpoint_url={moto.endpoint}&region=us-east-1&create_bucket=true"
        )
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    prefill(model, torch.tensor([rng.integers(0, cfg.vocab_size, 512).tolist()], device=device),
            device)  # fmt: skip
    try:
        for n in [int(x) for x in a.tokens.split(",")]:
            tokens = rng.integers(0, cfg.vocab_size, n).tolist()
            ids = torch.tensor([tokens], device=device)
            compute_s, kv = prefill(model, ids, device)
            row: dict[str, Any] = {"tokens": n, "prefill_s": compute_s,
                                   "kv_bytes": int(kv.nbytes)}  # fmt: skip
            for name, url in stores.items():
                with KVCloud.open(store=url, index=f"sqlite://{work}/{name}.db",
                                  secret="gpu-bench") as kvc:  # fmt: skip
                    kvc.push(ns, tokens, kv)
                    seconds, got = restore(kvc, ns, tokens, device, dtype)
                    stored = n // a.chunk * a.chunk
                    want = torch.from_numpy(kv[:, :, :stored].copy())
                    if dtype == torch.bfloat16:
                        want = want.view(torch.int16).view(torch.bfloat16)
                    if not torch.equal(got.cpu(), want):
                        raise RuntimeError(f"{name}: restored KV differs from the prefill's")
                    row[f"{name}_restore_s"] = seconds
                    row[f"{name}_speedup"] = compute_s / seconds  # (n: whole chunks)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if moto is not None:
            moto.stop()
    head = "| tokens | KV (MiB) | prefill (s) | " + " | ".join(
        f"{s} restore (s) | {s} ÷ prefill" for s in stores
    )
    print(head + " |\n|" + "---:|" * (3 + 2 * len(stores)))
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['kv_bytes'] / 2**20:.0f}", f"{r['prefill_s']:.3f}"]
        for s in stores:
            cells += [f"{r[f'{s}_restore_s']:.3f}", f"{r[f'{s}_speedup']:.2f}× faster"]
        print("| " + " | ".join(cells) + " |")
    if a.out:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                "device": gpu}  # fmt: skip
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
