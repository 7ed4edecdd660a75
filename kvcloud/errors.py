"""The exception hierarchy. Every error kvcloud raises on purpose derives from KVCloudError.

Callers on the inference path mostly never see these: the client turns corrupt or missing
objects into misses. They surface from the low-level APIs (segment decoding, stores, indexes)
and from configuration mistakes, where failing loudly is the right thing to do.
"""

from __future__ import annotations


class KVCloudError(Exception):
    """Root of every error raised by kvcloud."""


class ConfigError(KVCloudError, ValueError):
    """A URL, option or environment variable is malformed or inconsistent."""


class ProbeError(ConfigError):
    """A store or index did not answer a real request (a probe write, read and delete) the
    way a working deployment does. The message is one line: the redacted URL, what failed
    and the fix; ``target`` ("store" or "index"), ``url`` and ``fix`` hold the parts."""

    def __init__(self, target: str, url: str, what: str, fix: str) -> None:
        super().__init__(f"{target} {url}: {what}; fix: {fix}")
        self.target = target
        self.url = url
        self.what = what
        self.fix = fix


class LayoutError(KVCloudError, ValueError):
    """An array's shape or dtype does not match the namespace it is used with."""


# --- object format -------------------------------------------------------------------------


class CorruptObjectError(KVCloudError):
    """A stored object failed verification. The client treats this as a miss."""


class BadMagicError(CorruptObjectError):
    """The object does not start with the kvcloud magic bytes."""


class UnsupportedVersionError(CorruptObjectError):
    """The object was written by a format version this build cannot read."""


class TruncatedObjectError(CorruptObjectError):
    """Declared lengths disagree with the real size of the object."""


class MalformedHeaderError(CorruptObjectError):
    """The header is not a well-formed msgpack map with the expected fields and types."""


class DigestMismatchError(CorruptObjectError):
    """The object's bytes do not hash to the key it was stored under."""


class HeaderMismatchError(CorruptObjectError):
    """A valid object, but for another namespace, fingerprint, length or layout."""


class CodecError(CorruptObjectError):
    """The payload could not be decompressed (or decrypted) to the declared size."""


class DecryptionError(CodecError):
    """An encrypted object failed authentication (wrong key, tampered ciphertext, tag, nonce
    or header), or its encryption does not match the tenant's policy. A miss, like any
    corrupt object; the message never contains key material."""


# --- backends --------------------------------------------------------------------------------


class StoreError(KVCloudError):
    """An object-store operation failed."""


class ObjectNotFoundError(StoreError):
    """The object does not exist in the store."""


class StoreUnavailableError(StoreError):
    """The store could not be reached or kept failing after retries."""


class IndexBackendError(KVCloudError):
    """An index operation failed. (Not named IndexError, to keep the builtin usable.)"""


class IndexUnavailableError(IndexBackendError):
    """The index could not be reached or timed out."""


class UnsupportedCacheError(KVCloudError, ValueError):
    """A framework KV cache kvcloud cannot read or fill exactly: a layer type that does not
    hold the K and V of every past token (a sliding window that already dropped early tokens,
    a quantized or linear-attention layer), or a model whose KV does not follow from its
    token ids alone. Raised instead of storing or restoring KV that would be wrong."""


class BatchSizeError(UnsupportedCacheError):
    """Prefix KV is keyed by one token sequence, so a cache or prompt batch must hold one."""


class SessionNotFoundError(KVCloudError, KeyError):
    """No session record exists for this tenant and session id."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "session not found"


__all__ = [
    "BadMagicError",
    "BatchSizeError",
    "CodecError",
    "ConfigError",
    "CorruptObjectError",
    "DecryptionError",
    "DigestMismatchError",
    "HeaderMismatchError",
    "IndexBackendError",
    "IndexUnavailableError",
    "KVCloudError",
    "LayoutError",
    "MalformedHeaderError",
    "ObjectNotFoundError",
    "ProbeError",
    "SessionNotFoundError",
    "StoreError",
    "StoreUnavailableError",
    "TruncatedObjectError",
    "UnsupportedCacheError",
    "UnsupportedVersionError",
]


class PushError(StoreError):
    """Some chunks of a push could not be stored; ``result`` says what did get stored."""

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


__all__ += ["PushError"]
