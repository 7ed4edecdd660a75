"""Encoding: a chunk's KV (whole, or one part of it) into the bytes of a segment object.

Encoding is deterministic: the same chunk, codec and key always give the same bytes, hence the
same key. Encrypted segments (``enc.alg = "aes-256-gcm"``, see crypto.py) carry ciphertext ‖
tag as their payload: the codec's output is encrypted (compress first, then encrypt), and the
object key is still the digest of the stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
import numpy as np

from ..crypto import ALG, NONCE_BYTES, TAG_BYTES, TenantKey, encrypt_into, synthetic_nonce
from ..errors import ConfigError, LayoutError
from ..namespace import FP_BYTES, Namespace
from .codecs import CODECS, LOSSY_CODECS, encode_payload
from .digests import content_digest, digest_string, hasher, object_key, piece_digest
from .header import (
    DIGEST_ALGS,
    MAGIC,
    PIECE_DIGEST_BYTES,
    PREFIX,
    SEGMENT_VERSION,
    SegmentHeader,
    heads_str,
    parse_header,
    part_layout,
)


@dataclass(frozen=True)
class EncodedSegment:
    """An encoded object: its bytes, their content address and the header they carry."""

    digest: str
    data: bytes | bytearray
    header: SegmentHeader

    def key(self) -> str:
        return object_key(self.header.ns, self.digest)


def _pack_header(h: dict[str, Any]) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def _plain_parts(kv: np.ndarray) -> list[memoryview]:
    """The chunk's bytes in C order as contiguous byte views. A chunk sliced out of a longer
    array is strided, but each [layer, K|V] block of it is contiguous: hashing and encrypting
    block by block avoids a copy of the whole chunk."""
    if kv.flags.c_contiguous:
        return [memoryview(kv.reshape(-1).view(np.uint8))]
    return [
        memoryview(np.ascontiguousarray(kv[idx]).reshape(-1).view(np.uint8))
        for idx in np.ndindex(*kv.shape[:2])
    ]


def _layer_digests(kv: np.ndarray, plain: list[memoryview] | None = None) -> list[bytes]:
    """BLAKE3-256 of each layer's bytes of ``kv`` in payload order (format 3's table)."""
    plain = _plain_parts(kv) if plain is None else plain
    layers = kv.shape[0]
    if len(plain) == 1:
        step = len(plain[0]) // layers
        return [piece_digest(plain[0][i * step : (i + 1) * step]) for i in range(layers)]
    per_layer = len(plain) // layers  # [layer, K|V] blocks, in order
    out = []
    for i in range(layers):
        h = blake3.blake3()
        for view in plain[i * per_layer : (i + 1) * per_layer]:
            h.update(view)
        out.append(h.digest())
    return out


def _sealed_fields(header: dict[str, Any], plain_len: int, key: TenantKey) -> None:
    """An encrypted object's header fields as they are before its payload is encrypted:
    the nonce and the digest table are placeholders of the size they will have."""
    header["enc"] = {"alg": ALG, "kid": key.key_id, "nonce": bytes(NONCE_BYTES)}
    header["payload_len"] = plain_len + TAG_BYTES
    if header["v"] >= 3:
        # a placeholder of the same packed size: the table covers the ciphertext, known
        # only once it is written after the header (neither is part of the AAD)
        header["ld"] = [bytes(PIECE_DIGEST_BYTES)]


def _seal(
    header: dict[str, Any], parts: list[memoryview], plain_len: int, key: TenantKey, alg: str
) -> EncodedSegment:
    """Encrypt the payload parts under ``key`` and build the object around them."""
    _sealed_fields(header, plain_len, key)
    # the AAD comes from the parsed header, exactly as the decoder will rebuild it; the
    # placeholder nonce does not matter because the nonce is not part of the AAD
    aad = parse_header(header).aad()
    nonce = synthetic_nonce(key, aad, parts)
    header["enc"]["nonce"] = nonce
    hbytes = _pack_header(header)
    start = PREFIX.size + len(hbytes)
    buf = bytearray(start + plain_len + TAG_BYTES)
    PREFIX.pack_into(buf, 0, MAGIC, len(hbytes))
    # ciphertext and tag are written straight into the object buffer
    encrypt_into(key, nonce, aad, parts, memoryview(buf)[start:])
    if header["v"] >= 3:
        header["ld"] = [piece_digest(memoryview(buf)[start:])]
        packed = _pack_header(header)
        assert len(packed) == len(hbytes)  # same field sizes: the payload stays where it is
        hbytes = packed
    buf[PREFIX.size : start] = hbytes
    return EncodedSegment(digest=content_digest(buf, alg), data=buf, header=parse_header(header))


def _new_header(
    ns: Namespace,
    fp: bytes,
    parent: bytes,
    kv: np.ndarray,
    codec: str,
    version: int,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> tuple[np.ndarray, dict[str, Any], str]:
    """Check what is about to be encoded; return the checked array, the header of an
    unencrypted object (``payload_len`` still 0) and the digest algorithm."""
    if version not in DIGEST_ALGS:
        raise ConfigError(f"segment format version {version} is not supported")
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    if (codec in LOSSY_CODECS or ns.quant) and codec != ns.quant:
        raise ConfigError(
            f"codec {codec!r} in namespace with KV codec {ns.quant or 'lossless'!r}: a lossy "
            "codec is used exactly in the namespaces that name it"
        )
    if len(fp) != FP_BYTES or len(parent) != FP_BYTES:
        raise LayoutError("fingerprints must be 32 bytes")
    layout = part_layout(ns, heads, layers)
    if heads is None and layers is None:
        kv = ns.check_array(kv)
    elif kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != (
        layout[0],
        2,
        layout[1],
        layout[2],
    ):
        raise LayoutError(
            f"a part of KV heads {heads_str(heads)}, layers {heads_str(layers)} is "
            f"[{layout[0]}, 2, tokens, {layout[1]}, {layout[2]}], got {list(kv.shape)}"
        )
    elif kv.dtype.itemsize != ns.dtype_info.itemsize:
        raise LayoutError(f"array dtype {kv.dtype} does not match the namespace's {ns.dtype}")
    n_tokens = kv.shape[2]
    if not 0 < n_tokens <= ns.chunk_tokens:
        raise LayoutError(f"a segment holds 1..{ns.chunk_tokens} tokens, got {n_tokens}")
    header: dict[str, Any] = {
        "v": version,
        "ns": ns.id,
        "fp": bytes(fp),
        "parent": bytes(parent),
        "n": n_tokens,
        "layout": list(layout),
        "dtype": ns.dtype,
        "codec": codec,
        "raw_len": n_tokens * 2 * layout[0] * layout[1] * layout[2] * ns.dtype_info.itemsize,
        "payload_len": 0,
        "enc": {"alg": "none"},
    }
    if heads is not None:
        header["heads"] = [int(heads[0]), int(heads[1])]
    if layers is not None:
        header["layers"] = [int(layers[0]), int(layers[1])]
    return kv, header, DIGEST_ALGS[version]


def encode_segment(
    ns: Namespace,
    fp: bytes,
    parent: bytes,
    kv: np.ndarray,
    codec: str = "raw",
    level: int | None = None,
    *,
    key: TenantKey | None = None,
    version: int = SEGMENT_VERSION,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> EncodedSegment:
    """Encode one segment ``[layers, 2, n_tokens, kv_heads, head_dim]`` into object bytes.

    With ``key`` the payload is encrypted (after compression) and the object is still
    deterministic: the same chunk under the same key always encodes to the same bytes.
    ``version`` 1 writes the SHA-256-addressed format older builds read (tests, rollbacks).
    With ``heads`` (lo, hi) the object is a part: KV heads [lo, hi) of the chunk, ``kv``
    ``[layers, 2, n_tokens, hi - lo, head_dim]``; with ``layers`` (lo, hi) a part of a
    pipeline stage: only those layers, ``kv`` ``[hi - lo, 2, ...]``.
    """
    kv, header, alg = _new_header(ns, fp, parent, kv, codec, version, heads, layers)
    raw_len = header["raw_len"]
    if codec == "raw" and key is not None:
        return _seal(header, _plain_parts(kv), raw_len, key, alg)
    if codec == "raw":
        header["payload_len"] = raw_len
        if version >= 3:
            header["ld"] = _layer_digests(kv)
        hbytes = _pack_header(header)
        buf = bytearray(PREFIX.size + len(hbytes) + raw_len)
        PREFIX.pack_into(buf, 0, MAGIC, len(hbytes))
        buf[PREFIX.size : PREFIX.size + len(hbytes)] = hbytes
        # one copy: the (possibly strided) chunk lands straight in the object buffer
        dst = np.ndarray(kv.shape, dtype=kv.dtype, buffer=buf, offset=PREFIX.size + len(hbytes))
        dst[...] = kv
        data: bytes | bytearray = buf  # stores accept any buffer; no extra copy
    else:
        payload = encode_payload(np.ascontiguousarray(kv), codec, ns.dtype, level)
        if key is not None:
            return _seal(header, [memoryview(payload)], len(payload), key, alg)
        header["payload_len"] = len(payload)
        if version >= 3:
            header["ld"] = [piece_digest(payload)]
        hbytes = _pack_header(header)
        data = b"".join([PREFIX.pack(MAGIC, len(hbytes)), hbytes, payload])
    digest = content_digest(data, alg)
    return EncodedSegment(digest=digest, data=data, header=parse_header(header))


def encoded_size(
    ns: Namespace,
    n_tokens: int | None = None,
    *,
    key: TenantKey | None = None,
    version: int = SEGMENT_VERSION,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> int:
    """The size of the object ``encode_segment`` writes for a raw chunk of ``n_tokens``
    (default: a full chunk) with these arguments, without encoding one (sizing tools).

    The header is built by the encoder's own code from a stand-in of the chunk's shape with
    no memory behind it; every field of a raw object's header has a packed size that does
    not depend on the KV's values (fingerprints and digests are fixed-width), so zeros in
    their place give the exact size. Other codecs' sizes depend on the KV itself.
    """
    n = ns.chunk_tokens if n_tokens is None else n_tokens
    n_layers, n_heads, dim = part_layout(ns, heads, layers)
    kv = np.broadcast_to(np.zeros((), ns.dtype_info.storage), (n_layers, 2, n, n_heads, dim))
    zero_fp = bytes(FP_BYTES)
    _, header, _ = _new_header(ns, zero_fp, zero_fp, kv, "raw", version, heads, layers)
    if key is not None:
        _sealed_fields(header, header["raw_len"], key)
    else:
        header["payload_len"] = header["raw_len"]
        if version >= 3:
            header["ld"] = [bytes(PIECE_DIGEST_BYTES)] * n_layers  # _layer_digests' table
    return PREFIX.size + len(_pack_header(header)) + int(header["payload_len"])


@dataclass(frozen=True)
class SegmentParts:
    """An encoded object as the buffers that make it up, in order, not joined: the bytes
    ``b"".join(parts)`` are exactly what encode_segment returns for the same arguments.
    The parts may be views of the caller's KV array, which must not change until the
    object is stored."""

    digest: str
    parts: tuple[bytes | bytearray | memoryview, ...]
    header: SegmentHeader
    size: int

    def key(self) -> str:
        return object_key(self.header.ns, self.digest)


def encode_segment_parts(
    ns: Namespace,
    fp: bytes,
    parent: bytes,
    kv: np.ndarray,
    codec: str = "raw",
    level: int | None = None,
    *,
    key: TenantKey | None = None,
    version: int = SEGMENT_VERSION,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> SegmentParts:
    """encode_segment for a store that can write scattered buffers (``file://``'s writev).

    A raw, unencrypted chunk is not copied at all: the header is hashed and stored next to
    views of the KV itself (one per [layer, K|V] block when the chunk is strided). Copying
    3 MiB into a fresh object buffer costs page faults and a pass over memory that the
    write to the page cache repeats anyway. Every other codec, and encryption, goes
    through encode_segment (they produce a new buffer in any case).
    """
    if codec != "raw" or key is not None:
        seg = encode_segment(
            ns, fp, parent, kv, codec, level, key=key, version=version, heads=heads,
            layers=layers,
        )  # fmt: skip
        return SegmentParts(seg.digest, (seg.data,), seg.header, len(seg.data))
    kv, header, alg = _new_header(ns, fp, parent, kv, "raw", version, heads, layers)
    raw_len = header["payload_len"] = header["raw_len"]
    plain = _plain_parts(kv)
    if version >= 3:
        header["ld"] = _layer_digests(kv, plain)
    hbytes = _pack_header(header)
    head = PREFIX.pack(MAGIC, len(hbytes)) + hbytes
    parts: list[bytes | memoryview] = [head, *plain]
    # one object is hashed on one thread: pushes run several objects in parallel
    h = hasher(alg)
    for part in [head] if version >= 3 else parts:
        h.update(part)
    size = len(head) + raw_len
    return SegmentParts(digest_string(alg, h.hexdigest()), tuple(parts), parse_header(header), size)
