"""What the bench moves: the KV layout of its segments, the namespace it writes under, and
the random chunks and fresh fingerprint chains it pushes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from ...errors import KVCloudError
from ...models import KV_SHAPES
from ...namespace import Namespace

BENCH_MODEL = "kvcloud-bench"  # namespace model of everything the bench writes
BENCH_ENC_TENANT = "kvcloud-bench-encrypted"  # the bench's encrypting tenant (--encrypt)


class BenchError(KVCloudError):
    """The bench cannot run as asked (missing server binaries, a store without a baseline)."""


# --- layout -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchLayout:
    """The KV geometry of the segments the bench moves."""

    model: str  # the preset it came from, or "custom"
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int

    @classmethod
    def resolve(
        cls,
        model: str | None = "small",
        *,
        layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: str | None = None,
        chunk_tokens: int = 256,
    ) -> BenchLayout:
        """A preset, with any explicitly given dimension overriding it."""
        if model:
            shape = KV_SHAPES.get(model)
            if shape is None:
                raise BenchError(f"unknown model {model!r}; known: {', '.join(KV_SHAPES)}")
            base = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
        else:
            base = (0, 0, 0, "float16")
        given = (layers, kv_heads, head_dim, dtype)
        values = tuple(g if g is not None else b for g, b in zip(given, base, strict=True))
        name = model if model and all(g is None for g in given) else "custom"
        if not model and not all(given[:3]):
            raise BenchError("without --model, give --layers, --kv-heads and --head-dim")
        return cls(name, *values, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]

    def namespace(self, run_id: str) -> Namespace:
        # A fresh revision per run: the bench never shares a namespace (hence an object or
        # an entry) with real data or with another bench run, and cleanup can sweep it whole.
        return Namespace(
            model=BENCH_MODEL,
            revision=run_id,
            num_layers=self.layers,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            chunk_tokens=self.chunk_tokens,
        )


# --- data ----------------------------------------------------------------------------------------


def random_chunks(ns: Namespace, n: int, seed: int | None) -> list[np.ndarray]:
    """n contiguous chunks (like worker pages) of random bits viewed as the cache dtype."""
    rng = np.random.default_rng(seed)
    storage = np.dtype(ns.dtype_info.storage)
    raw = rng.integers(0, 256, size=(n, ns.chunk_bytes), dtype=np.uint8)
    return [raw[i].view(storage).reshape(ns.kv_shape(ns.chunk_tokens)) for i in range(n)]


def fresh_chain(ns: Namespace, n: int) -> list[tuple[bytes, bytes]]:
    """n (fp, parent) pairs chained from the namespace digest; random, so never seen before."""
    fps = [secrets.token_bytes(32) for _ in range(n)]
    return list(zip(fps, [ns.digest, *fps[:-1]], strict=True))
