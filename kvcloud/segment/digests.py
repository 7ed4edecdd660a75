"""Content addresses: the digest that names an object, and the checks that bytes match it.

The object key is a content digest, so identical content always lands on the same key and a
flipped bit anywhere is caught. Format version 3 (written now) is addressed by the BLAKE3-256
of its prefix and header, and the header holds a table of BLAKE3-256 digests of the payload's
pieces (``piece_bounds``): the key covers the table and the table covers every payload byte,
so the key still pins every byte. Version 2 is addressed by the BLAKE3-256 of the whole
object, version 1 by its SHA-256. The form shows in the key — ``<hex>.b3l`` for version 3,
``<hex>.b3`` for version 2, bare ``<hex>`` for version 1 — and the header's version must
agree with it, so it is never guessed.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Protocol

import blake3
import msgpack

from ..errors import (
    CorruptObjectError,
    DigestMismatchError,
    HeaderMismatchError,
    TruncatedObjectError,
)
from .header import DIGEST_ALGS, PREFIX, SegmentHeader, head_len, piece_bounds, read_header

DIGEST_HEX_LEN = 64
_B3_SUFFIX = ".b3"
_B3L_SUFFIX = ".b3l"
_SUFFIXES = {"sha256": "", "blake3": _B3_SUFFIX, "blake3-layers": _B3L_SUFFIX}
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}(\.b3l?)?$")


# BLAKE3 hashes about 2.5x faster than SHA-256 on one core here (4.4 vs 1.7 GB/s) and can
# split one large input over several; hashing every pulled byte is the largest cost of
# verify-on-read. One object on its own thread is the usual case (pulls run several objects
# in parallel), so only a large in-memory buffer is hashed on more than one thread.
_B3_THREADED_BYTES = 16 << 20


class Hasher(Protocol):
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


def hasher(alg: str, size_hint: int = 0) -> Hasher:
    """A fresh hash of ``alg`` (``sha256`` or a BLAKE3 form), threaded for a large input."""
    if alg == "sha256":
        return hashlib.sha256()
    threads = blake3.blake3.AUTO if size_hint >= _B3_THREADED_BYTES else 1
    return blake3.blake3(max_threads=threads)


def digest_string(alg: str, hexdigest: str) -> str:
    """A hex digest of ``alg`` in the form keys carry (with its suffix)."""
    return hexdigest + _SUFFIXES[alg]


def piece_digest(data: Any) -> bytes:
    """The digest of one payload piece, as a format 3 header's table holds it."""
    return blake3.blake3(data).digest()


def content_digest(data: bytes | bytearray | memoryview, alg: str | None = None) -> str:
    """The content address of ``data`` under ``alg``, in the form keys carry. Without
    ``alg``: the address the object's own header asks for (format 3's when its version says
    so), and the whole-data BLAKE3 of format 2 for anything else."""
    view = memoryview(data).cast("B")
    if alg is None:
        alg = "blake3-layers" if _object_version(view) == 3 else "blake3"
    if alg == "blake3-layers":
        end = head_len(view)
        if end is None:
            raise CorruptObjectError("not an object: no header to address")
        view = view[:end]
    return _address(view, alg)


def _address(view: memoryview, alg: str) -> str:
    """The digest of exactly ``view`` (format 3: the prefix and header, already cut)."""
    h = hasher(alg, len(view))
    h.update(view)
    return digest_string(alg, h.hexdigest())


def _object_version(view: memoryview) -> int | None:
    end = head_len(view)
    if end is None:
        return None
    try:
        h = msgpack.unpackb(view[PREFIX.size : end], raw=False, strict_map_key=True)
    except Exception:
        return None
    v = h.get("v") if isinstance(h, dict) else None
    return v if type(v) is int else None


def digest_matches(data: bytes | bytearray | memoryview, digest: str) -> bool:
    """Whether ``data`` is what ``digest`` (a key's last component) addresses."""
    try:
        verify(memoryview(data).cast("B"), digest)
    except CorruptObjectError:
        return False
    return True


def verify(view: memoryview, digest: str) -> None:
    """DigestMismatchError unless ``view`` is what ``digest`` addresses. For format 3: the
    header against the key, then (a header that matches but does not parse is the error its
    parse raises) every piece against the header's table."""
    alg = digest_alg(digest)
    if alg != "blake3-layers":
        if content_digest(view, alg) != digest:
            raise DigestMismatchError("object bytes do not match their content address")
        return
    end = head_len(view)
    if end is None or _address(view[:end], alg) != digest:
        raise DigestMismatchError("object header does not match its content address")
    try:
        header, offset = read_header(view)
    except TruncatedObjectError as exc:  # the payload's length: bytes missing or added
        raise DigestMismatchError(f"object bytes do not match their address: {exc}") from None
    check_version_alg(header, alg)
    check_pieces(header, view[offset:])


def check_pieces(header: SegmentHeader, payload: memoryview | bytes) -> None:
    """DigestMismatchError unless every payload piece matches its digest in the header's
    table (format 3)."""
    for i, ((a, b), want) in enumerate(zip(piece_bounds(header), header.pieces, strict=True)):
        if piece_digest(payload[a:b]) != want:
            raise DigestMismatchError(f"payload piece {i} does not match its header's digest")


def check_version_alg(header: SegmentHeader, alg: str) -> None:
    """HeaderMismatchError unless the header's format version is addressed by ``alg``."""
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
