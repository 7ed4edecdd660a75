"""Decoding a whole object held in memory: verify it, check it is the one asked for, decode
its payload.

The digest is checked before anything else and before the tag of an encrypted payload, so
damage in transit or at rest reads as a digest mismatch, and a tampered object re-stored under
its own correct address reads as a DecryptionError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..crypto import TenantKey, decrypt
from ..errors import DecryptionError, LayoutError, TruncatedObjectError
from ..namespace import DTYPES, Namespace
from .codecs import decode_payload_into
from .digests import check_version_alg, digest_alg, verify
from .header import MAX_UNBOUND_RAW_LEN, SegmentHeader, check_header, read_header


def check_encryption(
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


@dataclass(frozen=True)
class DecodedSegment:
    """A decoded object: its header and its KV ``[layers, 2, n_tokens, heads, head_dim]``."""

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
        verify(view, digest)
    header, offset = read_header(view)
    if digest is not None:
        check_version_alg(header, digest_alg(digest))
    check_header(header, ns=ns, fp=fp, parent=parent, n_tokens=n_tokens, heads=heads, layers=layers)
    if ns is None and header.raw_len > MAX_UNBOUND_RAW_LEN:
        raise TruncatedObjectError(
            f"object declares {header.raw_len} bytes; decode it with its namespace"
        )
    payload = view[offset:]
    k = check_encryption(header, key, require_encryption)
    if k is not None:
        payload = memoryview(decrypt(k, header.nonce, header.aad(), payload))
    storage = np.dtype(DTYPES[header.dtype].storage)
    if out is None:
        arr = np.empty(header.shape, dtype=storage)
    else:
        if out.shape != header.shape or out.dtype.itemsize != storage.itemsize:
            raise LayoutError(f"out has shape {list(out.shape)}, object {list(header.shape)}")
        arr = out
    decode_payload_into(
        payload,
        arr.view(storage) if arr.dtype != storage else arr,
        codec=header.codec,
        dtype=header.dtype,
        raw_len=header.raw_len,
    )
    return DecodedSegment(header=header, array=arr)
