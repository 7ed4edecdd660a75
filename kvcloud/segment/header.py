"""The segment header: the object's prefix and header fields, parsed and checked.

Parsing treats its input as hostile: every declared length is checked against the real size
and against the shape before anything is allocated, and every failure is a
CorruptObjectError subclass. ``check_header`` then compares a well-formed header with what
the caller asked for (namespace, fingerprints, part).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from ..crypto import ALG, KEY_ID_MAX_LEN, NONCE_BYTES, TAG_BYTES, segment_aad
from ..errors import (
    BadMagicError,
    CodecError,
    HeaderMismatchError,
    LayoutError,
    MalformedHeaderError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from ..namespace import DTYPES, FP_BYTES, QUANTIZABLE_DTYPES, Namespace
from ..quant import int8_payload_len
from .codecs import CODECS, LOSSY_CODECS

MAGIC = b"KVC1"
#: the version new objects are written in
SEGMENT_VERSION = 3
#: every version this build reads, and the digest that addresses objects of that version
DIGEST_ALGS = {1: "sha256", 2: "blake3", 3: "blake3-layers"}
#: bytes of one entry of a version 3 header's digest table
PIECE_DIGEST_BYTES = 32
MAX_HEADER_LEN = 64 * 1024
# Hard ceiling on any declared length. Pulls are bounded far lower: a segment must match
# the namespace, so it decodes to at most one chunk's bytes.
MAX_RAW_LEN = 1 << 31
# Decoding without a namespace (inspection tools) allocates at most this much.
MAX_UNBOUND_RAW_LEN = 256 << 20
#: magic and header length (little-endian u32), ahead of the header
PREFIX = struct.Struct("<4sI")


def head_len(view: memoryview) -> int | None:
    """The length of prefix and header when ``view`` starts like an object, else None."""
    if len(view) < PREFIX.size:
        return None
    magic, header_len = PREFIX.unpack_from(view, 0)
    if magic != MAGIC or header_len > MAX_HEADER_LEN or PREFIX.size + header_len > len(view):
        return None
    return PREFIX.size + header_len


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


def _field(h: dict[str, Any], name: str, kind: type) -> Any:
    if name not in h:
        raise MalformedHeaderError(f"header lacks field {name!r}")
    value = h[name]
    # bool is an int subclass; a header saying n=True is malformed, not 1
    if type(value) is not kind:
        raise MalformedHeaderError(f"header field {name!r} has type {type(value).__name__}")
    return value


def parse_header(h: Any) -> SegmentHeader:
    """The header an unpacked msgpack map describes; MalformedHeaderError (or
    UnsupportedVersionError, CodecError) unless every field is well-formed and consistent."""
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
    if len(view) < PREFIX.size:
        raise TruncatedObjectError(f"object is {len(view)} bytes, shorter than its prefix")
    magic, header_len = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadMagicError(f"bad magic {bytes(magic)!r}")
    if header_len > MAX_HEADER_LEN:
        raise MalformedHeaderError(f"header length {header_len} exceeds {MAX_HEADER_LEN}")
    if PREFIX.size + header_len > len(view):
        raise TruncatedObjectError("header runs past the end of the object")
    raw_header = view[PREFIX.size : PREFIX.size + header_len]
    try:
        # msgpack bounds every container by the buffer size, so a lying length cannot
        # allocate more than the header itself.
        h = msgpack.unpackb(raw_header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean the same
        raise MalformedHeaderError(f"header is not valid msgpack: {exc}") from None
    header = parse_header(h)
    offset = PREFIX.size + header_len
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
                f"object holds KV heads {heads_str(header.heads)}, asked for {heads_str(heads)}"
            )
        if header.layers != (None if layers is None else tuple(layers)):
            raise HeaderMismatchError(
                f"object holds layers {heads_str(header.layers)}, asked for {heads_str(layers)}"
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


def heads_str(heads: tuple[int, int] | None) -> str:
    """A part's range of heads or layers as messages show it (``all`` for None)."""
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
