"""Are vLLM's KV bytes and kvcloud's own worker's the same, for the same model and tokens?

Both serve SmolLM2-135M in float32 and both store ``[layers, 2, tokens, kv_heads, head_dim]``
chunks, but their namespaces differ on purpose (``vllm/llama`` with the connector's layout
version, ``hf-llama`` with the worker's), so neither restores what the other stored. This
measures why: a vLLM with the connector prefills a prompt into a ``file://`` store, the
chunks are pulled back by a plain ``KVCloud`` in the connector's namespace, and compared with
the K and V the worker's own model (workers/engine/model.py, the same weights) computes for the
same tokens. Any difference means a restore across the two would hand one engine KV that its own
prefill would not have produced: an answer could change.

    .venv/bin/python scripts/checks/compare_worker_vllm_kv.py [--tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from kvcloud import KVCloud
from scripts.fleet.vllm_fleet import (
    SMOLLM2,
    VLLMServer,
    connector_namespace,
    kvcloud_transfer_config,
    wait_stored,
)


class _Pages:
    """The worker model's KV sink, kept whole: ``[tokens, kv_heads, head_dim]`` per layer."""

    def __init__(self, layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert start == 0
        self.k[layer], self.v[layer] = k.clone(), v.clone()

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer], self.v[layer]
        assert k is not None and v is not None
        return k[:length], v[:length]


def worker_kv(tokens: list[int]) -> np.ndarray:
    from workers.engine import hf

    ckpt = hf.inspect_checkpoint(SMOLLM2)
    model, _ = hf.load_model(ckpt, torch.device("cpu"), torch.float32)
    pages = _Pages(ckpt.cfg.n_layers)
    model(torch.tensor(tokens), 0, pages)
    k = torch.stack([t for t in pages.k if t is not None])  # [L, T, H, D]
    v = torch.stack([t for t in pages.v if t is not None])
    return torch.stack([k, v], dim=1).numpy()  # [L, 2, T, H, D]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="a multiple of 256")
    args = ap.parse_args()
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(100, 40_000, size=args.tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "KVCLOUD_STORE": f"file://{tmp}/objects",
            "KVCLOUD_INDEX": f"sqlite://{tmp}/index.db",
            "KVCLOUD_SECRET": "compare-secret",
        }
        server = VLLMServer(
            "cmp", Path(tmp) / "vllm.log", transfer=kvcloud_transfer_config(), env=env
        )
        server.start().wait_ready()
        try:
            server.complete([*tokens, 11], max_tokens=1)  # the chunks of `tokens` are saved
            ns = connector_namespace()
            assert wait_stored(env, tokens, ns=ns) == args.tokens // 256
        finally:
            server.stop()
        with KVCloud.open(
            store=env["KVCLOUD_STORE"], index=env["KVCLOUD_INDEX"], secret=env["KVCLOUD_SECRET"]
        ) as kv:
            stored = kv.pull(kv.lookup(ns, tokens))  # [L, 2, T, H, D] float32
    own = worker_kv(tokens)
    assert stored.shape == own.shape, (stored.shape, own.shape)
    diff = np.abs(stored.astype(np.float64) - own.astype(np.float64))
    scale = np.abs(own).max()
    same = float((stored.view(np.uint32) == own.view(np.uint32)).mean())
    print(f"{args.tokens} tokens, SmolLM2-135M float32, K and V of all 30 layers")
    print(f"bit-identical elements: {100 * same:.2f} %")
    print(
        f"largest difference: {diff.max():.3e} (largest value {scale:.3e}); mean {diff.mean():.3e}"
    )
    for name, half in (("K", 0), ("V", 1)):
        d = diff[:, half]
        print(f"  {name}: layer 0 max {d[0].max():.3e}, last layer max {d[-1].max():.3e}")


if __name__ == "__main__":
    main()
