"""The segment object format (DESIGN §5) and its codecs.

    b"KVC1" | u32 header_len (LE) | header (msgpack map) | payload

The object key is a content digest, so identical content always lands on the same key and a
flipped bit anywhere is caught. Format version 3 (written now) is addressed by the BLAKE3-256
of its prefix and header, and the header holds a table of BLAKE3-256 digests of the payload's
pieces: one per layer for a raw, unencrypted payload (a layer is a contiguous
``[2, tokens, heads, dim]`` slice of it), one for the whole payload otherwise. The key covers
the table and the table covers every payload byte, so the key still pins every byte, and a
reader can check the header as soon as it has arrived and each layer as soon as its bytes have:
layer l is verified and usable while layer l + 1 is still in flight (``read_segment_into``'s
``on_layer``). Version 2 (read, and written on request) is addressed by the BLAKE3-256 of the
whole object, version 1 (read only) by its SHA-256. The form shows in the key — ``<hex>.b3l``
for version 3, ``<hex>.b3`` for version 2, bare ``<hex>`` for version 1 — and the header's
version must agree with it, so it is never guessed. Decoding treats its
input as hostile: every declared length is checked against the real size and against the
namespace before anything is allocated, and every failure is a CorruptObjectError subclass.

Encrypted segments (``enc.alg = "aes-256-gcm"``, see crypto.py) carry ciphertext ‖ tag as
their payload: the codec's output is encrypted (compress first, then encrypt), the object key
is still the digest of the stored bytes, and decoding needs the tenant's key. The digest is
checked before the tag, so damage in transit or at rest reads as a digest mismatch, and a
tampered object re-stored under its own correct address reads as a DecryptionError.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import lz4.block
import msgpack
import numpy as np
import zstandard

from .crypto import (
    ALG,
    KEY_ID_MAX_LEN,
    NONCE_BYTES,
    TAG_BYTES,
    StreamDecryptor,
    TenantKey,
    decrypt,
    encrypt_into,
    segment_aad,
    synthetic_nonce,
)
from .errors import (
    BadMagicError,
    CodecError,
    ConfigError,
    CorruptObjectError,
    DecryptionError,
    DigestMismatchError,
    HeaderMismatchError,
    LayoutError,
    MalformedHeaderError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from .namespace import DTYPES, FP_BYTES, QUANTIZABLE_DTYPES, Namespace
from .quant import dequantize_int8_into, int8_payload_len, quantize_int8

MAGIC = b"KVC1"
#: the version new objects are written in
SEGMENT_VERSION = 3
#: every version this build reads, and the digest that addresses objects of that version
DIGEST_ALGS = {1: "sha256", 2: "blake3", 3: "blake3-layers"}
CODECS = ("raw", "zstd", "lz4", "int8")
#: codecs whose decoded KV differs from what was encoded; each belongs to namespaces that
#: name it (Namespace.quant) and to no other
LOSSY_CODECS = ("int8",)
DIGEST_HEX_LEN = 64
_B3_SUFFIX = ".b3"
_B3L_SUFFIX = ".b3l"
_SUFFIXES = {"sha256": "", "blake3": _B3_SUFFIX, "blake3-layers": _B3L_SUFFIX}
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}(\.b3l?)?$")
#: bytes of one entry of a version 3 header's digest table
PIECE_DIGEST_BYTES = 32
MAX_HEADER_LEN = 64 * 1024
# Hard ceiling on any declared length. Pulls are bounded far lower: a segment must match
# the namespace, so it decodes to at most one chunk's bytes.
MAX_RAW_LEN = 1 << 31
# Decoding without a namespace (inspection tools) allocates at most this much.
MAX_UNBOUND_RAW_LEN = 256 << 20
_PREFIX = struct.Struct("<4sI")


# BLAKE3 hashes about 2.5x faster than SHA-256 on one core here (4.4 vs 1.7 GB/s) and can
# split one large input over several; hashing every pulled byte is the largest cost of
# verify-on-read. One object on its own thread is the usual case (pulls run several objects
# in parallel), so only a large in-memory buffer is hashed on more than one thread.
_B3_THREADED_BYTES = 16 << 20


class _Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def digest_alg(digest: str) -> str:
    """The algorithm a key's digest names (``blake3-layers``, ``blake3`` or ``sha256``);
    DigestMismatchError for anything that is not a digest this build writes or reads."""
    if not _DIGEST_RE.match(digest):
        raise DigestMismatchError(f"{digest[:80]!r} is not a content digest")
    if digest.endswith(_B3L_SUFFIX):
        return "blake3-layers"
    return "blake3" if digest.endswith(_B3_SUFFIX) else "sha256"


def _hasher(alg: str, size_hint: int = 0) -> _Hasher:
    if alg == "sha256":
        return hashlib.sha256()
    threads = blake3.blake3.AUTO if size_hint >= _B3_THREADED_BYTES else 1
    return blake3.blake3(max_threads=threads)


def _digest_string(alg: str, hexdigest: str) -> str:
    return hexdigest + _SUFFIXES[alg]


def _piece_digest(data: Any) -> bytes:
    return blake3.blake3(data).digest()


def _head_len(view: memoryview) -> int | None:
    """The length of prefix and header when ``view`` starts like an object, else None."""
    if len(view) < _PREFIX.size:
        return None
    magic, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC or header_len > MAX_HEADER_LEN or _PREFIX.size + header_len > len(view):
        return None
    return _PREFIX.size + header_len


def content_digest(data: bytes | bytearray | memoryview, alg: str | None = None) -> str:
    """The content address of ``data`` under ``alg``, in the form keys carry. Without
    ``alg``: the address the object's own header asks for (format 3's when its version says
    so), and the whole-data BLAKE3 of format 2 for anything else."""
    view = memoryview(data).cast("B")
    if alg is None:
        alg = "blake3-layers" if _object_version(view) == 3 else "blake3"
    if alg == "blake3-layers":
        end = _head_len(view)
        if end is None:
            raise CorruptObjectError("not an object: no header to address")
        view = view[:end]
    return _address(view, alg)


def _address(view: memoryview, alg: str) -> str:
    """The digest of exactly ``view`` (format 3: the prefix and header, already cut)."""
    h = _hasher(alg, len(view))
    h.update(view)
    return _digest_string(alg, h.hexdigest())


def _object_version(view: memoryview) -> int | None:
    end = _head_len(view)
    if end is None:
        return None
    try:
        h = msgpack.unpackb(view[_PREFIX.size : end], raw=False, strict_map_key=True)
    except Exception:
        return None
    v = h.get("v") if isinstance(h, dict) else None
    return v if type(v) is int else None


def digest_matches(data: bytes | bytearray | memoryview, digest: str) -> bool:
    """Whether ``data`` is what ``digest`` (a key's last component) addresses."""
    try:
        _verify(memoryview(data).cast("B"), digest)
    except CorruptObjectError:
        return False
    return True


def _verify(view: memoryview, digest: str) -> None:
    """DigestMismatchError unless ``view`` is what ``digest`` addresses. For format 3: the
    header against the key, then (a header that matches but does not parse is the error its
    parse raises) every piece against the header's table."""
    alg = digest_alg(digest)
    if alg != "blake3-layers":
        if content_digest(view, alg) != digest:
            raise DigestMismatchError("object bytes do not match their content address")
        return
    end = _head_len(view)
    if end is None or _address(view[:end], alg) != digest:
        raise DigestMismatchError("object header does not match its content address")
    try:
        header, offset = read_header(view)
    except TruncatedObjectError as exc:  # the payload's length: bytes missing or added
        raise DigestMismatchError(f"object bytes do not match their address: {exc}") from None
    _check_version_alg(header, alg)
    _check_pieces(header, view[offset:])


def _check_pieces(header: SegmentHeader, payload: memoryview | bytes) -> None:
    for i, ((a, b), want) in enumerate(zip(piece_bounds(header), header.pieces, strict=True)):
        if _piece_digest(payload[a:b]) != want:
            raise DigestMismatchError(f"payload piece {i} does not match its header's digest")


def _check_version_alg(header: SegmentHeader, alg: str) -> None:
    # the digest checks the bytes; this checks the bytes say the same thing as their address
    if DIGEST_ALGS[header.version] != alg:
        raise HeaderMismatchError(
            f"format version {header.version} objects are addressed by "
            f"{DIGEST_ALGS[header.version]}, this key names {alg}"
        )


def object_key(ns_id: str, digest: str) -> str:
    """Store-relative key: ``<ns>/<d[:2]>/<d>``; stores add their own prefix. ``d[:2]`` is
    hex for both digest forms (the ``.b3`` mark is a suffix), so the fan-out is even."""
    return f"{ns_id}/{digest[:2]}/{digest}"


def digest_from_key(key: str) -> str:
    return key.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    ns: str
    fp: bytes
    parent: bytes
    n_tokens: int
    layout: tuple[int, int, int]
    dtype: str
    codec: str
    raw_len: int
    payload_len: int
    encryption: dict[str, Any]
    # a part of a chunk: the KV heads [lo, hi) of the namespace's; None for a whole chunk
    heads: tuple[int, int] | None = None
    # a pipeline stage's part: layers [lo, hi) of the namespace's; None for every layer
    layers: tuple[int, int] | None = None
    # format 3: BLAKE3-256 of each payload piece (``piece_bounds``), which the key covers
    pieces: tuple[bytes, ...] = ()

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        layers, heads, dim = self.layout
        return (layers, 2, self.n_tokens, heads, dim)

    @property
    def encrypted(self) -> bool:
        return self.encryption.get("alg") == ALG

    @property
    def key_id(self) -> str | None:
        """Which key sealed the payload (``t:<hex>:v1``); None when it is not encrypted."""
        return self.encryption.get("kid") if self.encrypted else None

    @property
    def nonce(self) -> bytes:
        return self.encryption.get("nonce", b"") if self.encrypted else b""

    def aad(self) -> bytes:
        """The associated data an encrypted payload's tag covers (every field but the nonce)."""
        return segment_aad(
            version=self.version,
            ns=self.ns,
            fp=self.fp,
            parent=self.parent,
            n_tokens=self.n_tokens,
            layout=self.layout,
            dtype=self.dtype,
            codec=self.codec,
            raw_len=self.raw_len,
            payload_len=self.payload_len,
            key_id=self.key_id or "",
            heads=self.heads,
            layers=self.layers,
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": self.version,
            "ns": self.ns,
            "fp": self.fp.hex(),
            "parent": self.parent.hex(),
            "n_tokens": self.n_tokens,
            "layout": list(self.layout),
            "dtype": self.dtype,
            "codec": self.codec,
            "raw_len": self.raw_len,
            "payload_len": self.payload_len,
            # JSON-ready: the nonce as hex
            "encryption": {
                k: v.hex() if isinstance(v, bytes) else v for k, v in self.encryption.items()
            },
        }
        if self.heads is not None:
            d["heads"] = list(self.heads)
        if self.layers is not None:
            d["layers"] = list(self.layers)
        if self.pieces:
            d["pieces"] = [p.hex() for p in self.pieces]
        return d


def _piece_count(version: int, codec: str, encrypted: bool, layers: int) -> int:
    """How many digests a header's table holds: one per layer for a raw, unencrypted format 3
    payload (each layer is a contiguous slice), one for any other format 3 payload."""
    if version < 3:
        return 0
    return layers if codec == "raw" and not encrypted else 1


def piece_bounds(header: SegmentHeader) -> list[tuple[int, int]]:
    """The [start, end) of each payload piece its table covers (format 3; [] before)."""
    n = _piece_count(header.version, header.codec, header.encrypted, header.layout[0])
    if n == 0:
        return []
    step = header.payload_len // n
    return [(i * step, header.payload_len if i == n - 1 else (i + 1) * step) for i in range(n)]


@dataclass(frozen=True)
class EncodedSegment:
    digest: str
    data: bytes | bytearray
    header: SegmentHeader

    def key(self) -> str:
        return object_key(self.header.ns, self.digest)


# --- encoding --------------------------------------------------------------------------------


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
        return [_piece_digest(plain[0][i * step : (i + 1) * step]) for i in range(layers)]
    per_layer = len(plain) // layers  # [layer, K|V] blocks, in order
    out = []
    for i in range(layers):
        h = blake3.blake3()
        for view in plain[i * per_layer : (i + 1) * per_layer]:
            h.update(view)
        out.append(h.digest())
    return out


def _seal(
    header: dict[str, Any], parts: list[memoryview], plain_len: int, key: TenantKey, alg: str
) -> EncodedSegment:
    """Encrypt the payload parts under ``key`` and build the object around them."""
    header["enc"] = {"alg": ALG, "kid": key.key_id, "nonce": bytes(NONCE_BYTES)}
    header["payload_len"] = plain_len + TAG_BYTES
    if header["v"] >= 3:
        # a placeholder of the same packed size: the table covers the ciphertext, known
        # only once it is written after the header (neither is part of the AAD)
        header["ld"] = [bytes(PIECE_DIGEST_BYTES)]
    # the AAD comes from the parsed header, exactly as the decoder will rebuild it; the
    # placeholder nonce does not matter because the nonce is not part of the AAD
    aad = _parse_header(header).aad()
    nonce = synthetic_nonce(key, aad, parts)
    header["enc"]["nonce"] = nonce
    hbytes = _pack_header(header)
    start = _PREFIX.size + len(hbytes)
    buf = bytearray(start + plain_len + TAG_BYTES)
    _PREFIX.pack_into(buf, 0, MAGIC, len(hbytes))
    # ciphertext and tag are written straight into the object buffer
    encrypt_into(key, nonce, aad, parts, memoryview(buf)[start:])
    if header["v"] >= 3:
        header["ld"] = [_piece_digest(memoryview(buf)[start:])]
        packed = _pack_header(header)
        assert len(packed) == len(hbytes)  # same field sizes: the payload stays where it is
        hbytes = packed
    buf[_PREFIX.size : start] = hbytes
    return EncodedSegment(digest=content_digest(buf, alg), data=buf, header=_parse_header(header))


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
            f"a part of KV heads {_heads_str(heads)}, layers {_heads_str(layers)} is "
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
        buf = bytearray(_PREFIX.size + len(hbytes) + raw_len)
        _PREFIX.pack_into(buf, 0, MAGIC, len(hbytes))
        buf[_PREFIX.size : _PREFIX.size + len(hbytes)] = hbytes
        # one copy: the (possibly strided) chunk lands straight in the object buffer
        dst = np.ndarray(kv.shape, dtype=kv.dtype, buffer=buf, offset=_PREFIX.size + len(hbytes))
        dst[...] = kv
        data: bytes | bytearray = buf  # stores accept any buffer; no extra copy
    else:
        contiguous = np.ascontiguousarray(kv)
        if codec == "int8":
            payload = quantize_int8(contiguous, ns.dtype)
        elif codec == "zstd":
            payload = zstandard.ZstdCompressor(
                level=3 if level is None else level, write_content_size=True
            ).compress(memoryview(contiguous).cast("B"))
        else:
            payload = lz4.block.compress(memoryview(contiguous).cast("B"), store_size=False)
        if key is not None:
            return _seal(header, [memoryview(payload)], len(payload), key, alg)
        header["payload_len"] = len(payload)
        if version >= 3:
            header["ld"] = [_piece_digest(payload)]
        hbytes = _pack_header(header)
        data = b"".join([_PREFIX.pack(MAGIC, len(hbytes)), hbytes, payload])
    digest = content_digest(data, alg)
    return EncodedSegment(digest=digest, data=data, header=_parse_header(header))


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
    head = _PREFIX.pack(MAGIC, len(hbytes)) + hbytes
    parts: list[bytes | memoryview] = [head, *plain]
    # one object is hashed on one thread: pushes run several objects in parallel
    h = _hasher(alg)
    for part in [head] if version >= 3 else parts:
        h.update(part)
    size = len(head) + raw_len
    return SegmentParts(
        _digest_string(alg, h.hexdigest()), tuple(parts), _parse_header(header), size
    )


# --- decoding --------------------------------------------------------------------------------


def _field(h: dict[str, Any], name: str, kind: type) -> Any:
    if name not in h:
        raise MalformedHeaderError(f"header lacks field {name!r}")
    value = h[name]
    # bool is an int subclass; a header saying n=True is malformed, not 1
    if type(value) is not kind:
        raise MalformedHeaderError(f"header field {name!r} has type {type(value).__name__}")
    return value


def _parse_header(h: Any) -> SegmentHeader:
    if not isinstance(h, dict):
        raise MalformedHeaderError("header is not a map")
    version = _field(h, "v", int)
    if version not in DIGEST_ALGS:
        raise UnsupportedVersionError(f"segment format version {version} is not supported")
    ns = _field(h, "ns", str)
    fp = _field(h, "fp", bytes)
    parent = _field(h, "parent", bytes)
    if len(fp) != FP_BYTES or len(parent) != FP_BYTES:
        raise MalformedHeaderError("fingerprints in the header must be 32 bytes")
    n_tokens = _field(h, "n", int)
    layout = _field(h, "layout", list)
    if len(layout) != 3 or any(type(x) is not int or not 0 < x < 1 << 20 for x in layout):
        raise MalformedHeaderError("layout must be three positive ints")
    dtype = _field(h, "dtype", str)
    if dtype not in DTYPES:
        raise MalformedHeaderError(f"unknown dtype {dtype!r}")
    codec = _field(h, "codec", str)
    if codec not in CODECS:
        raise MalformedHeaderError(f"unknown codec {codec!r}")
    raw_len = _field(h, "raw_len", int)
    payload_len = _field(h, "payload_len", int)
    enc = _field(h, "enc", dict)
    alg = enc.get("alg")
    overhead = 0  # payload bytes beyond what the codec produced
    if type(alg) is str and alg == ALG:
        if set(enc) != {"alg", "kid", "nonce"}:
            raise MalformedHeaderError("encryption map must hold exactly alg, kid and nonce")
        kid, nonce = enc["kid"], enc["nonce"]
        if type(kid) is not str or not 0 < len(kid) <= KEY_ID_MAX_LEN:
            raise MalformedHeaderError("encryption key id must be a short string")
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            raise MalformedHeaderError(f"encryption nonce must be {NONCE_BYTES} bytes")
        overhead = TAG_BYTES
    elif not (type(alg) is str and alg == "none"):
        raise CodecError(f"unsupported encryption {alg!r}")
    if not 0 < n_tokens < 1 << 24:
        raise MalformedHeaderError(f"n_tokens {n_tokens} out of range")
    layers, heads, dim = layout
    expected_raw = layers * 2 * n_tokens * heads * dim * DTYPES[dtype].itemsize
    if raw_len != expected_raw:
        raise MalformedHeaderError(f"raw_len {raw_len} disagrees with shape ({expected_raw})")
    if not 0 <= payload_len <= MAX_RAW_LEN or raw_len > MAX_RAW_LEN:
        raise MalformedHeaderError("declared lengths out of range")
    if codec == "raw" and payload_len != raw_len + overhead:
        raise MalformedHeaderError("raw payload length must equal raw_len (plus the tag)")
    if codec == "int8":
        if dtype not in QUANTIZABLE_DTYPES:
            raise MalformedHeaderError(f"int8 payload for a {dtype} cache")
        if payload_len != int8_payload_len(layers, n_tokens, heads, dim) + overhead:
            raise MalformedHeaderError("int8 payload length disagrees with the shape")
    if payload_len < overhead:
        raise MalformedHeaderError("encrypted payload is shorter than its tag")
    want = _piece_count(version, codec, overhead > 0, layers)
    pieces: tuple[bytes, ...] = ()
    if want:
        table = _field(h, "ld", list)
        if len(table) != want or any(
            type(d) is not bytes or len(d) != PIECE_DIGEST_BYTES for d in table
        ):
            raise MalformedHeaderError(
                f"a format {version} header holds {want} piece digests of "
                f"{PIECE_DIGEST_BYTES} bytes"
            )
        pieces = tuple(table)
    elif "ld" in h:
        raise MalformedHeaderError(f"a format {version} header holds no piece digests")
    part = _range_field(h, "heads", layout[1])
    stage = _range_field(h, "layers", layout[0])
    return SegmentHeader(
        version=version,
        ns=ns,
        fp=fp,
        parent=parent,
        n_tokens=n_tokens,
        layout=(layers, heads, dim),
        dtype=dtype,
        codec=codec,
        raw_len=raw_len,
        payload_len=payload_len,
        encryption=dict(enc),
        heads=part,
        layers=stage,
        pieces=pieces,
    )


def _range_field(h: dict[str, Any], name: str, width: int) -> tuple[int, int] | None:
    """A part's range of heads or layers [lo, hi), which must span ``width`` (its layout's);
    None when the header has none (every head, every layer)."""
    if name not in h:
        return None
    rng = _field(h, name, list)
    if len(rng) != 2 or any(type(x) is not int for x in rng):
        raise MalformedHeaderError(f"{name} must be two ints")
    lo, hi = rng
    if not 0 <= lo < hi < 1 << 20 or hi - lo != width:
        raise MalformedHeaderError(f"{name} [{lo}, {hi}) disagree with the layout's {width}")
    return (lo, hi)


def read_header(data: bytes | bytearray | memoryview) -> tuple[SegmentHeader, int]:
    """Parse and validate the header; return it and the payload offset. Does not hash."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise TruncatedObjectError(f"object is {len(view)} bytes, shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadMagicError(f"bad magic {bytes(magic)!r}")
    if header_len > MAX_HEADER_LEN:
        raise MalformedHeaderError(f"header length {header_len} exceeds {MAX_HEADER_LEN}")
    if _PREFIX.size + header_len > len(view):
        raise TruncatedObjectError("header runs past the end of the object")
    raw_header = view[_PREFIX.size : _PREFIX.size + header_len]
    try:
        # msgpack bounds every container by the buffer size, so a lying length cannot
        # allocate more than the header itself.
        h = msgpack.unpackb(raw_header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean the same
        raise MalformedHeaderError(f"header is not valid msgpack: {exc}") from None
    header = _parse_header(h)
    offset = _PREFIX.size + header_len
    if len(view) - offset != header.payload_len:
        raise TruncatedObjectError(
            f"payload is {len(view) - offset} bytes, header declares {header.payload_len}"
        )
    return header, offset


def check_header(
    header: SegmentHeader,
    ns: Namespace | None = None,
    fp: bytes | None = None,
    parent: bytes | None = None,
    n_tokens: int | None = None,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> None:
    """A well-formed object can still be the wrong one (swapped out of band): compare.

    With ``ns``, ``heads`` and ``layers`` are the part asked for: KV heads [lo, hi) and layers
    [lo, hi) of the namespace's, or None for all of them; an object holding anything else is
    the wrong one."""
    if ns is not None:
        if header.heads != (None if heads is None else tuple(heads)):
            raise HeaderMismatchError(
                f"object holds KV heads {_heads_str(header.heads)}, asked for {_heads_str(heads)}"
            )
        if header.layers != (None if layers is None else tuple(layers)):
            raise HeaderMismatchError(
                f"object holds layers {_heads_str(header.layers)}, asked for {_heads_str(layers)}"
            )
        if header.ns != ns.id:
            raise HeaderMismatchError(f"object belongs to namespace {header.ns}, not {ns.id}")
        if (
            header.layout != part_layout(ns, header.heads, header.layers)
            or header.dtype != ns.dtype
        ):
            raise HeaderMismatchError("object layout or dtype differs from the namespace")
        if header.n_tokens > ns.chunk_tokens:
            raise HeaderMismatchError("object holds more tokens than a chunk")
        lossy = header.codec if header.codec in LOSSY_CODECS else ""
        if lossy != ns.quant:
            # the namespace id already differs; this holds even for a forged header
            raise HeaderMismatchError(
                f"object KV codec {lossy or 'lossless'} differs from the namespace's "
                f"{ns.quant or 'lossless'}"
            )
    if fp is not None and header.fp != fp:
        raise HeaderMismatchError("object fingerprint differs from the one asked for")
    if parent is not None and header.parent != parent:
        raise HeaderMismatchError("object parent fingerprint breaks the chain")
    if n_tokens is not None and header.n_tokens != n_tokens:
        raise HeaderMismatchError(f"object holds {header.n_tokens} tokens, expected {n_tokens}")


def part_record_fp(
    fp: bytes, heads: tuple[int, int], layers: tuple[int, int] | None = None
) -> bytes:
    """The index fingerprint under which one part of chunk ``fp`` is recorded until the
    chunk is registered (``KVCloud.offer_part``): derived, so no prompt's chain reaches it.
    A pipeline stage's part adds its layer range (a head-only part's record is unchanged)."""
    rng = struct.pack("<II", *heads) + (b"" if layers is None else struct.pack("<II", *layers))
    return hashlib.blake2b(b"kvcloud-part\0" + bytes(fp) + rng, digest_size=FP_BYTES).digest()


def _heads_str(heads: tuple[int, int] | None) -> str:
    return "all" if heads is None else f"[{heads[0]}, {heads[1]})"


def part_layout(
    ns: Namespace, heads: tuple[int, int] | None, layers: tuple[int, int] | None = None
) -> tuple[int, int, int]:
    """The layout of a part holding KV heads [lo, hi) and layers [lo, hi) of ``ns`` (all of
    them for None)."""
    n_heads, n_layers = ns.num_kv_heads, ns.num_layers
    if heads is not None:
        lo, hi = heads
        if not 0 <= lo < hi <= ns.num_kv_heads:
            raise LayoutError(f"KV heads [{lo}, {hi}) out of the namespace's {ns.num_kv_heads}")
        n_heads = hi - lo
    if layers is not None:
        lo, hi = layers
        if not 0 <= lo < hi <= ns.num_layers:
            raise LayoutError(f"layers [{lo}, {hi}) out of the namespace's {ns.num_layers}")
        n_layers = hi - lo
    return (n_layers, n_heads, ns.head_dim)


def _check_encryption(
    header: SegmentHeader, key: TenantKey | None, require_encryption: bool
) -> TenantKey | None:
    """The key to decrypt this object with, or None when it is plaintext (and allowed to be).

    An encrypting tenant accepts only encrypted objects: otherwise anyone who can write to the
    store and the index could slip plaintext KV of their choosing into its restores.
    """
    if not header.encrypted:
        if require_encryption:
            raise DecryptionError("object is not encrypted, but this tenant's objects must be")
        return None
    if key is None:
        raise DecryptionError("object is encrypted and no key was given to decode it")
    if header.key_id != key.key_id:
        # another tenant's key (or, after a rotation, another version of this one)
        raise DecryptionError("object is encrypted under another key")
    return key


def _decompress(header: SegmentHeader, payload: memoryview) -> bytes | memoryview:
    if header.codec == "raw":
        return payload
    try:
        if header.codec == "zstd":
            declared = zstandard.frame_content_size(payload)
            if declared != header.raw_len:
                raise CodecError(f"zstd frame declares {declared} bytes, header {header.raw_len}")
            out = zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=header.raw_len, allow_extra_data=False
            )
        else:
            out = lz4.block.decompress(payload, uncompressed_size=header.raw_len)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"{header.codec} payload does not decode: {exc}") from None
    if len(out) != header.raw_len:
        raise CodecError(f"payload decodes to {len(out)} bytes, expected {header.raw_len}")
    return out


@dataclass(frozen=True)
class DecodedSegment:
    header: SegmentHeader
    array: np.ndarray


def decode_segment(
    data: bytes | bytearray | memoryview,
    *,
    digest: str | None = None,
    ns: Namespace | None = None,
    fp: bytes | None = None,
    parent: bytes | None = None,
    n_tokens: int | None = None,
    out: np.ndarray | None = None,
    key: TenantKey | None = None,
    require_encryption: bool = False,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> DecodedSegment:
    """Verify and decode an object. With ``out``, the KV is copied into it and it is returned.

    ``digest`` is the expected content digest (the key's last component); give it whenever the
    bytes came from a store. The other arguments say what the caller asked for (``heads``:
    the part, with ``ns``). ``key``
    decrypts an encrypted object (DecryptionError without it, or with another tenant's);
    ``require_encryption`` refuses a plaintext one.
    """
    view = memoryview(data).cast("B")
    if digest is not None:
        _verify(view, digest)
    header, offset = read_header(view)
    if digest is not None:
        _check_version_alg(header, digest_alg(digest))
    check_header(header, ns=ns, fp=fp, parent=parent, n_tokens=n_tokens, heads=heads, layers=layers)
    if ns is None and header.raw_len > MAX_UNBOUND_RAW_LEN:
        raise TruncatedObjectError(
            f"object declares {header.raw_len} bytes; decode it with its namespace"
        )
    payload = view[offset:]
    k = _check_encryption(header, key, require_encryption)
    if k is not None:
        payload = memoryview(decrypt(k, header.nonce, header.aad(), payload))
    storage = np.dtype(DTYPES[header.dtype].storage)
    if out is None:
        arr = np.empty(header.shape, dtype=storage)
    else:
        if out.shape != header.shape or out.dtype.itemsize != storage.itemsize:
            raise LayoutError(f"out has shape {list(out.shape)}, object {list(header.shape)}")
        arr = out
    _decode_payload_into(header, payload, arr.view(storage) if arr.dtype != storage else arr)
    return DecodedSegment(header=header, array=arr)


def _decode_payload_into(header: SegmentHeader, payload: memoryview, out: np.ndarray) -> None:
    """Decode a (decrypted) payload into ``out``, an array of the storage dtype."""
    if header.codec == "int8":
        dequantize_int8_into(payload, out, header.dtype)  # straight into the cache dtype
        return
    raw = _decompress(header, payload)
    src = np.frombuffer(raw, dtype=out.dtype).reshape(header.shape)
    np.copyto(out, src, casting="no")


# --- streaming decode: straight into the destination -----------------------------------------

_STREAM_PIECE = 256 * 1024


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def readinto(self, buf: Any, /) -> int | None: ...


class _Damaged(TruncatedObjectError):
    """An object shorter or longer than it says, or with a bad prefix: for a format 3 object,
    whose header is checked against the key, a digest mismatch (read_segment_into)."""


def _read_exact(reader: Reader, n: int, what: str) -> bytes:
    parts: list[bytes] = []
    left = n
    while left > 0:
        chunk = reader.read(left)
        if not chunk:
            raise _Damaged(f"object ends inside its {what}")
        parts.append(chunk)
        left -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _readinto_exact(reader: Reader, view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        got = reader.readinto(view[filled:])
        if not got:
            raise _Damaged("object ends inside its payload")
        filled += got


class _NoHash:
    def update(self, data: Any, /) -> None:
        pass

    def digest(self) -> bytes:
        return b""

    def hexdigest(self) -> str:
        return ""


def read_segment_into(
    reader: Reader,
    out: np.ndarray,
    *,
    digest: str | None = None,
    ns: Namespace | None = None,
    fp: bytes | None = None,
    parent: bytes | None = None,
    n_tokens: int | None = None,
    key: TenantKey | None = None,
    require_encryption: bool = False,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> tuple[SegmentHeader, int]:
    """Decode an object from a stream into ``out`` without holding the object in memory.
    Returns the header and the object's size in bytes.

    ``on_layer(l)`` is called once per layer, in order, as soon as ``out[l]`` holds layer l
    verified: for a format 3 raw, unencrypted object right after that layer's bytes match
    their digest (while the next layer is still to be read), for any other object after the
    whole object was verified. When an exception ends the read, the layers already handed
    over are verified and the rest of ``out`` is garbage.

    The header is read and checked first (so a hostile length never allocates), then a raw
    payload is read straight into ``out`` while being hashed (into each of its
    ``[layer, K|V]`` blocks when ``out`` is a slice of a larger array along the token axis);
    an
    encrypted raw payload is read piece by piece into a small buffer, hashed, and decrypted
    into ``out``. If anything fails — including the digest and the tag, checked last —
    ``out`` holds garbage and the caller must not use it. ``key`` and
    ``require_encryption`` as for decode_segment.
    """
    alg = digest_alg(digest) if digest is not None else None
    # without a digest to compare with there is nothing to hash for; format 3 hashes the
    # header and each piece on their own
    h: _Hasher = _hasher(alg) if alg in ("sha256", "blake3") else _NoHash()
    try:
        return _read_segment_into(
            reader,
            out,
            h,
            alg,
            digest,
            ns=ns,
            fp=fp,
            parent=parent,
            n_tokens=n_tokens,
            key=key,
            require_encryption=require_encryption,
            heads=heads,
            layers=layers,
            on_layer=on_layer,
        )
    except CorruptObjectError as exc:
        if alg == "blake3-layers" and isinstance(exc, _Damaged):
            # bytes missing, added, or before a header that matches the key
            raise DigestMismatchError(f"object bytes do not match their address: {exc}") from exc
        if alg in (None, "blake3-layers") or isinstance(exc, DigestMismatchError):
            # (format 3 checked its header against the key before anything else)
            raise
        # Report what decode_segment reports for the same bytes: a damaged object is a
        # digest mismatch first, whichever check happened to see the damage.
        if not _rest_matches(reader, h, alg, digest):
            raise DigestMismatchError("object bytes do not match their content address") from exc
        raise


def _rest_matches(reader: Reader, h: _Hasher, alg: str, digest: str | None) -> bool:
    """Hash what is left of the object; True if the whole object matches ``digest``."""
    left = MAX_RAW_LEN + MAX_HEADER_LEN + (1 << 20)  # past any valid object: give up
    while left > 0:
        piece = reader.read(min(_STREAM_PIECE, left))
        if not piece:
            return _digest_string(alg, h.hexdigest()) == digest
        h.update(piece)
        left -= len(piece)
    return False


def _layer_views(out: np.ndarray) -> list[list[memoryview]] | None:
    """``out`` (``[layers, 2, tokens, heads, dim]``) as byte views of contiguous pieces in
    payload order, grouped by layer: each layer whole when ``out`` is C-contiguous, else
    its K and V blocks when each is (a chunk's slice of a longer array); None otherwise."""
    layers = out.shape[0]
    if out.flags.c_contiguous:
        flat = memoryview(out.reshape(-1).view(np.uint8))
        step = len(flat) // layers
        return [[flat[i * step : (i + 1) * step]] for i in range(layers)]
    if out.ndim != 5:
        return None
    blocks = [[out[layer, kv] for kv in range(out.shape[1])] for layer in range(layers)]
    if not all(b.flags.c_contiguous for group in blocks for b in group):
        return None
    return [[memoryview(b.reshape(-1).view(np.uint8)) for b in group] for group in blocks]


def _read_segment_into(
    reader: Reader,
    out: np.ndarray,
    h: _Hasher,
    alg: str | None,
    digest: str | None,
    *,
    ns: Namespace | None,
    fp: bytes | None,
    parent: bytes | None,
    n_tokens: int | None,
    key: TenantKey | None,
    require_encryption: bool,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> tuple[SegmentHeader, int]:
    prefix = _read_exact(reader, _PREFIX.size, "prefix")
    h.update(prefix)
    magic, header_len = _PREFIX.unpack(prefix)
    tabled = alg == "blake3-layers"
    if magic != MAGIC:
        raise (_Damaged if tabled else BadMagicError)(f"bad magic {magic!r}")
    if header_len > MAX_HEADER_LEN:
        raise (_Damaged if tabled else MalformedHeaderError)(
            f"header length {header_len} exceeds {MAX_HEADER_LEN}"
        )
    raw_header = _read_exact(reader, header_len, "header")
    h.update(raw_header)
    if alg == "blake3-layers" and content_digest(prefix + raw_header, alg) != digest:
        # the key addresses the header: nothing it says is read before this holds
        raise DigestMismatchError("object header does not match its content address")
    try:
        hd = msgpack.unpackb(raw_header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise MalformedHeaderError(f"header is not valid msgpack: {exc}") from None
    header = _parse_header(hd)
    if alg is not None:
        _check_version_alg(header, alg)
    check_header(header, ns=ns, fp=fp, parent=parent, n_tokens=n_tokens, heads=heads, layers=layers)
    if ns is None and header.raw_len > MAX_UNBOUND_RAW_LEN:
        raise TruncatedObjectError("object declares too many bytes; decode it with its namespace")
    storage = np.dtype(DTYPES[header.dtype].storage)
    if out.shape != header.shape or out.dtype.itemsize != storage.itemsize:
        raise LayoutError(f"out has shape {list(out.shape)}, object {list(header.shape)}")
    k = _check_encryption(header, key, require_encryption)
    size = _PREFIX.size + header_len + header.payload_len
    # format 3: the payload's own digest(s), checked against the (verified) header's table
    ph: _Hasher = blake3.blake3() if tabled else _NoHash()

    def check_end() -> None:
        extra = reader.read(1)
        if extra:
            h.update(extra)  # the object is still hashed whole (see read_segment_into)
            raise _Damaged("object has bytes after its declared payload")
        if alg in ("sha256", "blake3") and _digest_string(alg, h.hexdigest()) != digest:
            raise DigestMismatchError("object bytes do not match their content address")

    def all_layers() -> None:
        if on_layer is not None:
            for layer in range(header.layout[0]):
                on_layer(layer)

    layers = _layer_views(out) if header.codec == "raw" and k is None else None
    if layers is not None:
        # hash each piece right after it lands, while it is still in cache; in format 3
        # each layer is checked (and handed over) as soon as its last byte is in
        per_layer = tabled and len(header.pieces) == len(layers)
        for i, views in enumerate(layers):
            lh: _Hasher = blake3.blake3() if per_layer else h
            for view in views:
                for off in range(0, len(view), _STREAM_PIECE):
                    piece = view[off : off + _STREAM_PIECE]
                    _readinto_exact(reader, piece)
                    lh.update(piece)
            if per_layer:
                if lh.digest() != header.pieces[i]:
                    raise DigestMismatchError(f"layer {i} does not match its header's digest")
                if on_layer is not None:
                    on_layer(i)
        check_end()
        if not per_layer:
            all_layers()
        return header, size
    if header.codec == "raw" and k is not None and out.flags.c_contiguous:
        view = memoryview(out.reshape(-1).view(np.uint8))
        # ciphertext lands in a small buffer, is hashed there and decrypted into the page:
        # one pass over the page, no copy of the object
        dec = StreamDecryptor(k, header.nonce, header.aad())
        scratch = memoryview(bytearray(min(_STREAM_PIECE, len(view))))
        for off in range(0, len(view), _STREAM_PIECE):
            piece = scratch[: min(_STREAM_PIECE, len(view) - off)]
            _readinto_exact(reader, piece)
            h.update(piece)
            ph.update(piece)
            dec.update_into(piece, view[off:])
        tag = _read_exact(reader, TAG_BYTES, "tag")
        h.update(tag)
        ph.update(tag)
        authentic = dec.finish(tag)
        check_end()  # a damaged object is a digest mismatch first
        if tabled and ph.digest() != header.pieces[0]:
            raise DigestMismatchError("object payload does not match its header's digest")
        if not authentic:
            raise DecryptionError(
                "object failed authentication (wrong key, or tampered ciphertext or header)"
            )
        all_layers()
        return header, size
    # compressed payloads are at most a little larger than what they decode to
    if header.payload_len > header.raw_len + (1 << 20) + (TAG_BYTES if k else 0):
        raise MalformedHeaderError("payload is larger than its decoded size allows")
    payload = _read_exact(reader, header.payload_len, "payload")
    h.update(payload)
    check_end()
    if tabled:
        _check_pieces(header, payload)
    plain: bytes = (
        payload if k is None else decrypt(k, header.nonce, header.aad(), memoryview(payload))
    )
    _decode_payload_into(
        header, memoryview(plain), out.view(storage) if out.dtype != storage else out
    )
    all_layers()
    return header, size
