"""Shared test data: namespaces and deterministic KV arrays of every supported dtype."""

from __future__ import annotations

import numpy as np

from kvcloud import Namespace

DTYPE_CASES = ("float16", "bfloat16", "float32", "int8")


def make_ns(dtype: str = "float16", chunk_tokens: int = 16, **kw: object) -> Namespace:
    params: dict[str, object] = dict(
        model="test-model",
        revision="r1",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )
    params.update(kw)
    return Namespace(**params)  # type: ignore[arg-type]


def make_kv(ns: Namespace, n_tokens: int, seed: int = 0) -> np.ndarray:
    """Random bits of the namespace's storage dtype, NaN payloads and all: a bit-exact
    round trip must preserve every pattern, not just 'nice' floats."""
    rng = np.random.default_rng(seed)
    shape = ns.kv_shape(n_tokens)
    nbytes = int(np.prod(shape)) * ns.dtype_info.itemsize
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(np.dtype(ns.dtype_info.storage)).reshape(shape)


def make_tokens(n: int, seed: int = 0, vocab: int = 50_000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int64)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()
