"""Namespaces, tenant keys and prefix fingerprints.

A Namespace is everything that decides whether two workers produce the same KV bytes for the
same tokens. Its digest seeds every fingerprint chain, so segments never cross namespaces.
Fingerprints are keyed by a per-tenant key derived from a master secret, so a tenant cannot
probe (or even name) another tenant's entries. Everything here is pure hashing over a
canonical byte encoding: identical in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import numpy as np

from .errors import ConfigError, LayoutError

FORMAT_VERSION = 1
DEFAULT_CHUNK_TOKENS = 256
FP_BYTES = 32
NS_ID_BYTES = 16
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class DType:
    """A cache dtype: its name, width, and the numpy dtype its raw bits are carried in."""

    name: str
    itemsize: int
    storage: str  # numpy dtype used to hold the bits (bfloat16/fp8 travel as raw integers)


#: KV codecs that change the bytes a restore gives back (lossy): each is part of the namespace,
#: so its segments are never served to a worker that expects exact KV. "" is lossless.
QUANTS = ("", "int8")
#: cache dtypes the lossy codecs can quantize and decode into
QUANTIZABLE_DTYPES = ("float32", "float16", "bfloat16")

DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, "<f4"),
        DType("float16", 2, "<f2"),
        DType("bfloat16", 2, "<u2"),
        DType("int8", 1, "i1"),
        DType("uint8", 1, "u1"),
        DType("float8_e4m3fn", 1, "u1"),
        DType("float8_e5m2", 1, "u1"),
    )
}


def dtype_info(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown cache dtype {name!r}; known: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class Namespace:
    """What makes KV compatible. Change any field and no segment is shared any more.

    ``revision`` should pin the weights (a commit, a seed, or a digest of the weight files);
    ``extra`` carries anything else that changes the KV bytes (RoPE scaling, a quantization
    scheme) as a free-form string. ``quant`` names a lossy KV codec (``int8``: 1 byte per
    element plus a scale per token and head) that every segment of the namespace uses; it is
    part of the digest, so lossy and exact KV never mix. Empty means lossless.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    revision: str = ""
    dtype: str = "float16"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    format_version: int = FORMAT_VERSION
    extra: str = ""
    quant: str = ""
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("Namespace.model must be non-empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"Namespace.{name} must be a positive int, got {value!r}")
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(
                f"format_version {self.format_version} is not supported (this build writes "
                f"{FORMAT_VERSION})"
            )
        dtype_info(self.dtype)
        if self.quant not in QUANTS:
            raise ConfigError(f"unknown KV codec {self.quant!r}; known: int8 (or none)")
        if self.quant and self.dtype not in QUANTIZABLE_DTYPES:
            raise ConfigError(
                f"the {self.quant} KV codec needs a float cache dtype "
                f"({', '.join(QUANTIZABLE_DTYPES)}), not {self.dtype}"
            )
        fields: list[Any] = [
            "kvcloud-namespace",
            self.format_version,
            self.model,
            self.revision,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.chunk_tokens,
            self.extra,
        ]
        if self.quant:
            # appended only when set, so every lossless namespace keeps the id it always had
            fields.append(self.quant)
        canonical = msgpack.packb(fields)
        digest = hashlib.blake2b(canonical, digest_size=FP_BYTES, person=b"kvc-ns-v1").digest()
        object.__setattr__(self, "_digest", digest)

    # -- identity ---------------------------------------------------------------------------

    @property
    def digest(self) -> bytes:
        """32 bytes; fp_0 of every fingerprint chain in this namespace."""
        return self._digest

    @property
    def id(self) -> str:
        """Short hex id used in object keys and index keys."""
        return self._digest[:NS_ID_BYTES].hex()

    # -- geometry ---------------------------------------------------------------------------

    @property
    def dtype_info(self) -> DType:
        return DTYPES[self.dtype]

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def kv_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """layers × 2 (K, V) × kv_heads × head_dim × bytes per element (the usual formula)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_info.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk_tokens

    def check_array(self, arr: np.ndarray, n_tokens: int | None = None) -> np.ndarray:
        """Validate a KV array against this namespace; return it viewed as the storage dtype."""
        if not isinstance(arr, np.ndarray):
            raise LayoutError(f"expected a numpy array, got {type(arr).__name__}")
        info = self.dtype_info
        if arr.dtype.itemsize != info.itemsize:
            raise LayoutError(
                f"array dtype {arr.dtype} has {arr.dtype.itemsize}-byte elements; namespace "
                f"dtype {self.dtype} needs {info.itemsize}"
            )
        storage = np.dtype(info.storage)
        if arr.dtype != storage:
            # bfloat16/fp8 arrive as ml_dtypes or integer views; float16 must really be float16
            if info.storage in ("<f2", "<f4") and arr.dtype.kind != "f":
                raise LayoutError(f"array dtype {arr.dtype} is not {self.dtype}")
            arr = arr.view(storage)
        if arr.ndim != 5 or arr.shape[1] != 2:
            raise LayoutError(
                f"expected shape [layers, 2, tokens, kv_heads, head_dim], got {list(arr.shape)}"
            )
        if (arr.shape[0], arr.shape[3], arr.shape[4]) != self.layout:
            raise LayoutError(
                f"array layout {[arr.shape[0], arr.shape[3], arr.shape[4]]} does not match "
                f"namespace layout {list(self.layout)}"
            )
        if n_tokens is not None and arr.shape[2] != n_tokens:
            raise LayoutError(f"array holds {arr.shape[2]} tokens, expected {n_tokens}")
        return arr

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_digest", None)
        d["id"] = self.id
        return d


# --- tenant keys and fingerprints ------------------------------------------------------------


def derive_tenant_key(master_secret: bytes, tenant: str) -> bytes:
    """Per-tenant fingerprint key: HMAC-SHA256(master secret, tenant id).

    Derived where the secret lives (the worker or the client process), never accepted from a
    caller, so knowing a tenant's name is not enough to compute its fingerprints.
    """
    if not isinstance(master_secret, bytes | bytearray) or len(master_secret) == 0:
        raise ConfigError("master secret must be non-empty bytes")
    if not tenant:
        raise ConfigError("tenant id must be non-empty")
    return hmac.new(
        bytes(master_secret), b"kvcloud-tenant-v1\x00" + tenant.encode("utf-8"), hashlib.sha256
    ).digest()


def key_id(master_secret: bytes, tenant: str) -> str:
    """A public name for a tenant's fingerprint key: 12 hex digits of
    HMAC-SHA256(tenant key, "kvcloud-key-id-v1"). Servers showing the same id compute the
    same fingerprints (they share KV); the id is one-way, so printing it on a start line or
    a dashboard reveals neither the key nor the secret."""
    digest = hmac.new(derive_tenant_key(master_secret, tenant), b"kvcloud-key-id-v1", "sha256")
    return digest.hexdigest()[:12]


def tokens_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a little-endian uint32 array (the canonical byte form hashed into fps)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise LayoutError(f"tokens must be 1-D, got shape {list(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise LayoutError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise LayoutError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def _step(parent: bytes, key: bytes, chunk: np.ndarray, person: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=FP_BYTES, key=key, person=person)
    h.update(chunk.tobytes())
    return h.digest()


def chunk_fingerprints(
    ns: Namespace, tokens: Sequence[int] | np.ndarray, tenant_key: bytes
) -> list[bytes]:
    """fp_i = BLAKE2b_k(fp_{i-1} ‖ tokens of chunk i), fp_0 = ns digest, for every full chunk."""
    toks = tokens_array(tokens)
    step = ns.chunk_tokens * toks.itemsize
    raw = memoryview(np.ascontiguousarray(toks)).cast("B")
    # One keyed state set up once and copied per chunk: the same hashes as _step, a third
    # faster for a long prompt (the per-call parameter and key setup was that third).
    keyed = hashlib.blake2b(digest_size=FP_BYTES, key=tenant_key, person=b"kvc-fp-v1")
    fps: list[bytes] = []
    parent = ns.digest
    for start in range(0, len(raw) - step + 1, step):
        h = keyed.copy()
        h.update(parent)
        h.update(raw[start : start + step])
        parent = h.digest()
        fps.append(parent)
    return fps


def tail_fingerprint(
    ns: Namespace, parent: bytes, tail_tokens: Sequence[int] | np.ndarray, tenant_key: bytes
) -> bytes:
    """Fingerprint of a partial (shorter than a chunk) tail; never shared by prefix lookups."""
    toks = tokens_array(tail_tokens)
    if not 0 < len(toks) < ns.chunk_tokens:
        raise LayoutError(f"a tail holds 1..{ns.chunk_tokens - 1} tokens, got {len(toks)}")
    return _step(parent, tenant_key, toks, b"kvc-tail-v1")


def next_fingerprint(
    parent: bytes, chunk_tokens: Sequence[int] | np.ndarray, tenant_key: bytes
) -> bytes:
    """One step of the chain: the fp of a full chunk given its parent's fp (for callers that
    extend a prefix token by token, like a decoding worker)."""
    return _step(parent, tenant_key, tokens_array(chunk_tokens), b"kvc-fp-v1")
