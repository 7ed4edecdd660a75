"""The int8 KV codec: one signed byte per element and one float32 scale per (layer, K|V,
token, head), i.e. symmetric absmax quantization over head_dim.

Payload: ``scales`` (little-endian float32, ``[layers, 2, n, heads]``) ‖ ``q`` (int8,
``[layers, 2, n, heads, head_dim]``). A value decodes to ``q * scale``, written straight into
the cache dtype (float32, float16, or bfloat16 carried as uint16 bits). Per token and head
because K and V magnitudes differ by orders between heads and positions (attention sinks):
one scale per tensor would flatten most heads to a few levels.

Lossy: a namespace that uses it says so (``Namespace.quant``), so its KV is never served
where exact KV is expected.
"""

from __future__ import annotations

import numpy as np

from .errors import CodecError, LayoutError

_QMAX = 127
# float32 values from which a cast to each dtype rounds to inf (a hostile scale must not
# decode to inf): half-way past the largest finite value
_INF_FROM = {"float32": np.inf, "float16": 65520.0, "bfloat16": 3.3961776e38}


def int8_payload_len(layers: int, n_tokens: int, heads: int, head_dim: int) -> int:
    return layers * 2 * n_tokens * heads * (4 + head_dim)


def _as_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.view("<u2").astype("<u4") << 16).view("<f4")
    return x.astype("<f4", copy=False)


def quantize_int8(kv: np.ndarray, dtype: str) -> bytes:
    """``kv`` ``[layers, 2, n, heads, head_dim]`` in its storage dtype → payload bytes."""
    layers, _, n, heads, _ = kv.shape
    scales = np.empty((layers, 2, n, heads), dtype="<f4")
    q = np.empty(kv.shape, dtype="i1")
    for layer in range(layers):  # one layer at a time bounds the float32 temporaries
        x = _as_float32(kv[layer], dtype)
        if not np.isfinite(x).all():
            raise LayoutError("the int8 KV codec cannot encode non-finite KV values")
        amax = np.abs(x).max(axis=-1)
        s = amax / np.float32(_QMAX)
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
        q[layer] = np.clip(np.rint(x * inv[..., None]), -_QMAX, _QMAX)
        scales[layer] = s
    return scales.tobytes() + q.tobytes()


def dequantize_int8_into(payload: memoryview, out: np.ndarray, dtype: str) -> None:
    """Decode a payload into ``out`` (the storage dtype, shape ``[layers, 2, n, heads,
    head_dim]``). The caller has checked the payload's length against the shape."""
    layers, _, n, heads, _ = out.shape
    n_scales = layers * 2 * n * heads
    scales = np.frombuffer(payload, dtype="<f4", count=n_scales).reshape(layers, 2, n, heads)
    q = np.frombuffer(payload, dtype="i1", offset=4 * n_scales).reshape(out.shape)
    # the digest proves the bytes are what was stored, not that a writer was honest
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError("int8 payload has negative or non-finite scales")
    # computed in float32 like the decode itself, so an honest absmax never trips it
    with np.errstate(over="ignore"):
        top = np.float32(scales.max(initial=0.0)) * np.float32(_QMAX)
    if not np.isfinite(top) or top >= _INF_FROM[dtype]:
        raise CodecError(f"int8 payload has scales that overflow {dtype}")
    for layer in range(layers):
        x = q[layer].astype("<f4") * scales[layer][..., None]
        if dtype == "bfloat16":
            # round to nearest even, as torch does when casting float32 to bfloat16
            b = x.view("<u4")
            out[layer] = (
                (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> 16
            ).astype("<u2")
        else:
            out[layer] = x
