"""Payload codecs: what each codec makes of a chunk's bytes, and back.

``raw`` stores the bytes as they are, ``zstd`` and ``lz4`` compress them losslessly, ``int8``
quantizes them (quant.py). Decoding treats the payload as hostile: its declared size is
checked against the header's before anything is allocated.
"""

from __future__ import annotations

import lz4.block
import numpy as np
import zstandard

from ..errors import CodecError
from ..quant import dequantize_int8_into, quantize_int8

CODECS = ("raw", "zstd", "lz4", "int8")
#: codecs whose decoded KV differs from what was encoded; each belongs to namespaces that
#: name it (Namespace.quant) and to no other
LOSSY_CODECS = ("int8",)


def encode_payload(kv: np.ndarray, codec: str, dtype: str, level: int | None) -> bytes:
    """A C-contiguous chunk ``kv`` as the payload of ``codec`` (any but ``raw``, whose payload
    is the chunk itself)."""
    if codec == "int8":
        return quantize_int8(kv, dtype)
    if codec == "zstd":
        return zstandard.ZstdCompressor(
            level=3 if level is None else level, write_content_size=True
        ).compress(memoryview(kv).cast("B"))
    return lz4.block.compress(memoryview(kv).cast("B"), store_size=False)


def _decompress(codec: str, payload: memoryview, raw_len: int) -> bytes | memoryview:
    if codec == "raw":
        return payload
    try:
        if codec == "zstd":
            declared = zstandard.frame_content_size(payload)
            if declared != raw_len:
                raise CodecError(f"zstd frame declares {declared} bytes, header {raw_len}")
            out = zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=raw_len, allow_extra_data=False
            )
        else:
            out = lz4.block.decompress(payload, uncompressed_size=raw_len)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"{codec} payload does not decode: {exc}") from None
    if len(out) != raw_len:
        raise CodecError(f"payload decodes to {len(out)} bytes, expected {raw_len}")
    return out


def decode_payload_into(
    payload: memoryview, out: np.ndarray, *, codec: str, dtype: str, raw_len: int
) -> None:
    """Decode a (decrypted) payload of ``codec`` into ``out``, an array of the storage dtype
    in the header's shape; ``dtype`` is the cache's (the header's), ``raw_len`` the size the
    header declares for the decoded bytes."""
    if codec == "int8":
        dequantize_int8_into(payload, out, dtype)  # straight into the cache dtype
        return
    raw = _decompress(codec, payload, raw_len)
    src = np.frombuffer(raw, dtype=out.dtype).reshape(out.shape)
    np.copyto(out, src, casting="no")
