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


def frame_object(header: dict, payload: bytes) -> bytes:
    """An object around ``header`` (a decoded msgpack map) and ``payload``, as a forger who
    knows the format would build it: a format 3 header's digest table is recomputed for the
    payload (one digest per layer of a raw, unencrypted payload, one for the whole otherwise),
    so the result verifies under its own content address whatever was changed."""
    import struct

    import blake3
    import msgpack

    from kvcloud.segment import MAGIC

    if header.get("v") == 3:
        encrypted = header.get("enc", {}).get("alg") != "none"
        n = header["layout"][0] if header.get("codec") == "raw" and not encrypted else 1
        step = len(payload) // n
        header = dict(header)
        header["ld"] = [
            blake3.blake3(
                payload[i * step : len(payload) if i == n - 1 else (i + 1) * step]
            ).digest()
            for i in range(n)
        ]
    h = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(h)) + h + payload


def readdress(data: bytes | bytearray) -> tuple[bytes, str]:
    """``data`` (an object someone changed) made consistent with itself and its own content
    address, as a forger would: the digest table of a format 3 header recomputed over the
    payload as it now is. Returns the bytes and their address's digest."""
    import struct

    import msgpack

    from kvcloud.segment import content_digest

    hlen = struct.unpack_from("<I", data, 4)[0]  # after the 4-byte magic
    header = msgpack.unpackb(bytes(data[8 : 8 + hlen]), raw=False)
    fixed = frame_object(header, bytes(data[8 + hlen :]))
    return fixed, content_digest(fixed)
