"""Redis index layout: where entries, sessions and counters live, and how an entry is encoded.

Key schema (``prefix`` defaults to ``kvc``)::

    {prefix}:h:{ns}:{bucket}             hash of entries: field = fingerprint, value = entry
    {prefix}:s:{scope}:{session_id}      session record, optional TTL
    {prefix}:counters                    hash of named counters
    {prefix}:n:{ns}                      live entries, bytes, tokens by expiry slot (redis_stats)
    {prefix}:namespaces                  set of the namespaces that have such a hash
    {prefix}:e:{ns}:{fp}                 entry of releases before 0.13 (read for gc/verify/stats)

Entries live in small hashes ("buckets"), ``buckets`` per namespace (URL option, default
4096), picked by the fingerprint's leading bits. Redis keeps a hash of at most
``hash-max-listpack-entries`` (128) fields of at most 64 bytes as one flat listpack: about
115 bytes per entry, where a key per entry costs about 340 (a dictionary entry, an expiry
entry, the key's and the value's allocations). The binary field (32 bytes) and value (at most
62 bytes with a standard object key, :func:`pack_value`) are sized to stay in it.

Expiry, two ways (URL option ``field_ttl``):

- *value expiry* (format 1; Redis 7.0, which has no per-field expiry): each value carries its
  own ``expires_at`` and every reader treats an expired value as absent; a bucket's own TTL is
  the latest of its entries', and a registration now and then deletes the expired fields of
  the bucket it writes to. A renewal rewrites the value.
- *field TTL* (format 2, 8 bytes shorter: no ``expires_at``; servers with ``HPEXPIRE``: Redis
  7.4+, Valkey 9+): each field has its own TTL, the server drops expired fields by itself
  (no dead entry waits for a sweep), and a renewal is an ``HPEXPIRE … GT`` of the field
  instead of a rewrite of its value, which cannot create a field deleted meanwhile. The bucket
  keeps a TTL of its own, the latest of its entries', as above: ``maxmemory-policy
  volatile-lru`` evicts only keys that have one.

Readers understand both formats on any server, so a fleet can switch while running (which
format a RedisIndex writes: :meth:`~kvcloud.indexes.redis.RedisIndex.uses_field_ttl`).
"""

from __future__ import annotations

import functools
import logging
import re
import struct
import threading
import zlib
from urllib.parse import quote, unquote

from .base import EntryRecord, IndexEntry

log = logging.getLogger("kvcloud.index")

DEFAULT_PREFIX = "kvc"
# Decoded entries kept by their packed bytes (expiry excluded). Entries are immutable values,
# the same prefixes are looked up again and again (system prompts, continued sessions), and
# building the frozen IndexEntry costs more than the round trip's share per entry. ~0.5 KB an
# entry.
_DECODE_CACHE_SIZE = 8192
DEFAULT_BUCKETS = 4096
MAX_BUCKETS = 1 << 24

# The value: format (1), expires_at, created, n_tokens, size, then the object key: a form
# byte and either the 32-byte digest of a standard key (<ns>/<d[:2]>/<d>[.b3|.b3l]) or the key as
# UTF-8 (any other key, e.g. one written by a custom client). Format 2 (field TTL) is the
# same without expires_at.
_HEAD = struct.Struct("<BddIQ")
_HEAD2 = struct.Struct("<BdIQ")
_EXPIRES = struct.Struct("<d")
_FORMAT = 1
_FORMAT_FIELD_TTL = 2
_KEY_RAW, _KEY_BLAKE3, _KEY_SHA256, _KEY_BLAKE3_LAYERS = 0, 1, 2, 3
# the digest forms of standard keys (segment.py), longest suffix first
_SUFFIX_FORMS = {".b3l": _KEY_BLAKE3_LAYERS, ".b3": _KEY_BLAKE3}
_FORM_SUFFIXES = {_KEY_BLAKE3_LAYERS: ".b3l", _KEY_BLAKE3: ".b3", _KEY_SHA256: ""}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEXES = re.compile(r"(?:[0-9a-f]{64})*")
# A hex fingerprint's field is its 32 raw bytes; any other field has another length.
_FP_BYTES = 32
FP_WIDTH = str(_FP_BYTES)
# Bucket names are looked up in a per-namespace table (formatting 128 names per lookup cost
# as much as the rest of the client side) when there are at most this many buckets...
_NAME_TABLE_MAX = 1 << 14
# ...for this many namespaces at a time (a table of 4,096 names is ~0.35 MB, of the most
# allowed ~1.4 MB).
_NAME_TABLES = 4


def pack_key(ns: str, key: str) -> bytes:
    """The object key as stored: 33 bytes for the standard keys of this namespace."""
    head = ns + "/"
    if key.startswith(head):
        rest = key[len(head) :]
        suffix = next((x for x in _SUFFIX_FORMS if rest.endswith(x)), "")
        digest = rest[3 : len(rest) - len(suffix)]
        form = _SUFFIX_FORMS.get(suffix, _KEY_SHA256)
        if rest[2:3] == "/" and rest[:2] == digest[:2] and _HEX64.fullmatch(digest):
            return bytes((form,)) + bytes.fromhex(digest)
    return bytes((_KEY_RAW,)) + key.encode("utf-8")


def _unpack_key(ns: str, packed: bytes) -> str:
    form, body = packed[0], packed[1:]
    if form == _KEY_RAW:
        return body.decode("utf-8")
    if form not in _FORM_SUFFIXES or len(body) != 32:
        raise ValueError(f"bad object key form {form} ({len(body)} bytes)")
    digest = body.hex()
    return f"{ns}/{digest[:2]}/{digest}" + _FORM_SUFFIXES[form]


def pack_value(ns: str, entry: IndexEntry, expires_at: float | None) -> bytes:
    """Format 1 with ``expires_at``; format 2 (field TTL: the server keeps the expiry) when it
    is None."""
    if expires_at is None:
        head = _HEAD2.pack(_FORMAT_FIELD_TTL, entry.created, entry.n_tokens, entry.size)
    else:
        head = _HEAD.pack(_FORMAT, expires_at, entry.created, entry.n_tokens, entry.size)
    return head + pack_key(ns, entry.object_key)


@functools.lru_cache(maxsize=_DECODE_CACHE_SIZE)
def _unpack_cached(ns: str, body: bytes) -> IndexEntry:
    # body is the value from `created` on; lru_cache never caches an exception, so
    # undecodable values are reported every time.
    created, n_tokens, size = struct.unpack_from("<dIQ", body)
    return IndexEntry(_unpack_key(ns, body[20:]), n_tokens, size, created)


def unpack_value(ns: str, raw: bytes) -> tuple[IndexEntry, float | None]:
    """(entry, expires_at) of a stored value, expires_at None for a field-TTL value (the
    server holds it); ValueError for anything else."""
    if len(raw) > _HEAD.size and raw[0] == _FORMAT:
        return _unpack_cached(ns, raw[9:]), _EXPIRES.unpack_from(raw, 1)[0]
    if len(raw) > _HEAD2.size and raw[0] == _FORMAT_FIELD_TTL:
        return _unpack_cached(ns, raw[1:]), None
    raise ValueError(f"not an index entry value ({len(raw)} bytes)")


def entry_field(fp: str) -> bytes:
    """The hash field of a fingerprint: its 32 bytes for a (lowercase) hex fingerprint, else
    its UTF-8 followed by 0xff (never in UTF-8), padded so it is never 32 bytes long."""
    if _HEX64.fullmatch(fp):
        return bytes.fromhex(fp)
    raw = fp.encode("utf-8") + b"\xff"
    return raw + b"\xff" if len(raw) == 32 else raw


def entry_fields(fps: list[str]) -> tuple[list[bytes], bytes | None]:
    """entry_field of every fp and, when all are hex fingerprints (one fromhex for the lot), those
    32-byte fields joined (None otherwise): what the lookup script takes as one argument."""
    joined = "".join(fps)
    if len(joined) == 64 * len(fps) and _HEXES.fullmatch(joined):
        raw = bytes.fromhex(joined)
        return [raw[i : i + _FP_BYTES] for i in range(0, len(raw), _FP_BYTES)], raw
    return [entry_field(fp) for fp in fps], None


def _fp_of_field(field: bytes) -> str:
    if len(field) == 32:
        return field.hex()
    return field[: field.index(b"\xff")].decode("utf-8")


def is_expired(raw: bytes, now: float) -> bool:
    """Whether a stored value is a format-1 value whose own expiry has passed (a field-TTL
    value's expiry is the server's business)."""
    return len(raw) > _HEAD.size and raw[0] == _FORMAT and _EXPIRES.unpack_from(raw, 1)[0] <= now


def entry_record(
    ns: str, field: bytes, raw: bytes, now: float, field_ttl_ms: int | None = None
) -> EntryRecord | None:
    """The EntryRecord of a stored (field, value), None if it does not decode or has expired;
    ``field_ttl_ms`` is the field's HPTTL for a field-TTL value (None: not asked)."""
    try:
        fp = _fp_of_field(field)
        entry, expires_at = unpack_value(ns, raw)
    except Exception as exc:
        log.warning("redis index: undecodable entry in %s skipped: %s", ns, exc)
        return None
    if expires_at is None:  # field TTL, held by the server
        if field_ttl_ms is not None and field_ttl_ms == -2:
            return None  # expired between HGETALL and HPTTL
        if field_ttl_ms is not None and field_ttl_ms >= 0:
            expires_at = now + field_ttl_ms / 1000
    elif expires_at <= now:
        return None
    return EntryRecord(ns=ns, fp=fp, entry=entry, expires_at=expires_at)


def _component(value: str) -> str:
    """Percent-encode one key component: no ':', glob characters, braces or '%' survive."""
    return quote(value, safe="")


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def as_text(key: bytes | str) -> str:
    return key.decode("utf-8") if isinstance(key, bytes) else key


class KeyLayout:
    """The keys of one index: ``prefix`` and the ``buckets`` per namespace (a power of two),
    the bucket of every fingerprint, and the way back from a key to its parts."""

    def __init__(self, prefix: str, buckets: int) -> None:
        self.prefix = prefix
        self.buckets = buckets
        self._counters_key = f"{prefix}:counters"
        self._name_tables: dict[str, list[str]] = {}
        self._name_lock = threading.Lock()

    def _legacy_key(self, ns: str, fp: str) -> str:
        return f"{self.prefix}:e:{_component(ns)}:{_component(fp)}"

    def _bucket_head(self, ns: str) -> str:
        return f"{self.prefix}:h:{_component(ns)}:"

    def _buckets(self, ns: str, fields: list[bytes]) -> list[str]:
        """The bucket key of every field: the leading 32 bits of a hex fingerprint (uniform
        already), a CRC of anything else."""
        mask = self.buckets - 1
        numbers = [
            (int.from_bytes(f[:4], "big") if len(f) == _FP_BYTES else zlib.crc32(f)) & mask
            for f in fields
        ]
        names = self._bucket_names(ns)
        if names is not None:
            return [names[n] for n in numbers]
        head = self._bucket_head(ns)
        return [f"{head}{n:x}" for n in numbers]

    def _bucket_names(self, ns: str) -> list[str] | None:
        """Every bucket key of ``ns`` by number, kept for the last few namespaces; None when
        there are too many buckets for a table."""
        if self.buckets > _NAME_TABLE_MAX:
            return None
        names = self._name_tables.get(ns)
        if names is not None:
            return names
        with self._name_lock:  # readers only get(); changes are one thread at a time
            names = self._name_tables.get(ns)
            if names is None:
                if len(self._name_tables) >= _NAME_TABLES:
                    # Oldest first out: a worker serves one or two namespaces, so this is rare.
                    del self._name_tables[next(iter(self._name_tables))]
                head = self._bucket_head(ns)
                names = [f"{head}{n:x}" for n in range(self.buckets)]
                self._name_tables[ns] = names
        return names

    def _session_key(self, scope: str, session_id: str) -> str:
        return f"{self.prefix}:s:{_component(scope)}:{_component(session_id)}"

    def _split_key(self, key: bytes | str, kind: str) -> tuple[str, str] | None:
        text = as_text(key)
        head = f"{self.prefix}:{kind}:"
        if not text.startswith(head):
            return None
        first, sep, second = text[len(head) :].partition(":")
        if not sep or ":" in second:
            return None  # not written by us
        return unquote(first), unquote(second)

    def _patterns(self, ns: str | None) -> tuple[str, str]:
        scope = "*" if ns is None else glob_escape(_component(ns)) + ":*"
        head = glob_escape(self.prefix)
        return f"{head}:h:{scope}", f"{head}:e:{scope}"


__all__ = ["DEFAULT_BUCKETS", "DEFAULT_PREFIX", "KeyLayout"]
