"""Streaming decode: an object read from a stream straight into its destination array.

For a format 3 object the header is checked against the key as soon as it has arrived, and
each layer of a raw, unencrypted payload as soon as its bytes have: layer l is verified and
usable while layer l + 1 is still in flight (``read_segment_into``'s ``on_layer``). The object
is never held in memory whole, and hashing overlaps the transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import blake3
import msgpack
import numpy as np

from ..crypto import TAG_BYTES, StreamDecryptor, TenantKey, decrypt
from ..errors import (
    BadMagicError,
    CorruptObjectError,
    DecryptionError,
    DigestMismatchError,
    LayoutError,
    MalformedHeaderError,
    TruncatedObjectError,
)
from ..namespace import DTYPES, Namespace
from .codecs import decode_payload_into
from .decode import check_encryption
from .digests import (
    Hasher,
    check_pieces,
    check_version_alg,
    content_digest,
    digest_alg,
    digest_string,
    hasher,
)
from .header import (
    MAGIC,
    MAX_HEADER_LEN,
    MAX_RAW_LEN,
    MAX_UNBOUND_RAW_LEN,
    PREFIX,
    SegmentHeader,
    check_header,
    parse_header,
)

_STREAM_PIECE = 256 * 1024


class Reader(Protocol):
    """What read_segment_into reads from: a file, or a store's object stream."""

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
    h: Hasher = hasher(alg) if alg in ("sha256", "blake3") else _NoHash()
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


def _rest_matches(reader: Reader, h: Hasher, alg: str, digest: str | None) -> bool:
    """Hash what is left of the object; True if the whole object matches ``digest``."""
    left = MAX_RAW_LEN + MAX_HEADER_LEN + (1 << 20)  # past any valid object: give up
    while left > 0:
        piece = reader.read(min(_STREAM_PIECE, left))
        if not piece:
            return digest_string(alg, h.hexdigest()) == digest
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
    h: Hasher,
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
    prefix = _read_exact(reader, PREFIX.size, "prefix")
    h.update(prefix)
    magic, header_len = PREFIX.unpack(prefix)
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
    header = parse_header(hd)
    if alg is not None:
        check_version_alg(header, alg)
    check_header(header, ns=ns, fp=fp, parent=parent, n_tokens=n_tokens, heads=heads, layers=layers)
    if ns is None and header.raw_len > MAX_UNBOUND_RAW_LEN:
        raise TruncatedObjectError("object declares too many bytes; decode it with its namespace")
    storage = np.dtype(DTYPES[header.dtype].storage)
    if out.shape != header.shape or out.dtype.itemsize != storage.itemsize:
        raise LayoutError(f"out has shape {list(out.shape)}, object {list(header.shape)}")
    k = check_encryption(header, key, require_encryption)
    size = PREFIX.size + header_len + header.payload_len
    # format 3: the payload's own digest(s), checked against the (verified) header's table
    ph: Hasher = blake3.blake3() if tabled else _NoHash()

    def check_end() -> None:
        extra = reader.read(1)
        if extra:
            h.update(extra)  # the object is still hashed whole (see read_segment_into)
            raise _Damaged("object has bytes after its declared payload")
        if alg in ("sha256", "blake3") and digest_string(alg, h.hexdigest()) != digest:
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
            lh: Hasher = blake3.blake3() if per_layer else h
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
        check_pieces(header, payload)
    plain: bytes = (
        payload if k is None else decrypt(k, header.nonce, header.aad(), memoryview(payload))
    )
    decode_payload_into(
        memoryview(plain),
        out.view(storage) if out.dtype != storage else out,
        codec=header.codec,
        dtype=header.dtype,
        raw_len=header.raw_len,
    )
    all_layers()
    return header, size
