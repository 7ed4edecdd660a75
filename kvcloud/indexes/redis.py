"""Redis index: the shared index for many workers on many machines.

Key schema (``prefix`` defaults to ``kvc``)::

    {prefix}:h:{ns}:{bucket}             hash of entries: field = fingerprint, value = entry
    {prefix}:s:{scope}:{session_id}      session record, optional TTL
    {prefix}:counters                    hash of named counters
    {prefix}:e:{ns}:{fp}                 entry of releases before 0.13 (read for gc/verify/stats)

Entries live in small hashes ("buckets"), ``buckets`` per namespace (URL option, default
4096), picked by the fingerprint's leading bits. Redis keeps a hash of at most
``hash-max-listpack-entries`` (128) fields of at most 64 bytes as one flat listpack: about
115 bytes per entry, where a key per entry costs about 340 (a dictionary entry, an expiry
entry, the key's and the value's allocations). The binary field (32 bytes) and value (at most
62 bytes with a standard object key, :func:`_pack_value`) are sized to stay in it.

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

``field_ttl=auto`` (the default) picks field TTL on Redis 7.4+, and value expiry on Redis 7.0
and on Valkey, whose hashes leave their compact listpack encoding as soon as one field has a
TTL (measured in docs/OPERATIONS.md: 140 bytes an entry against 106; Redis 8 keeps them
compact, 121 against 119). ``field_ttl=on`` forces it wherever the server has ``HPEXPIRE``.
Readers understand both formats on any server, so a fleet can switch while running.

Lookups are one ``EVALSHA`` on the request path: a script that walks the prompt's chain and
returns only the run of hits (``lookup_run``) or every entry (``lookup``). The TTL renewal of
the hits and the counter increments are sent by one background thread (:class:`Deferred`),
``renew_delay`` (50 ms) later, and only for hits whose expiry is more than a hundredth of the
TTL (at most a minute) old, so a hot prefix costs a write a minute rather than one per lookup
(and gc's least-recently-used order has that resolution). A
renewal rewrites only a value that still exists and has not expired, so it can never
resurrect an entry deleted or expired meanwhile.

Every other operation touches a single key or is a non-transactional pipeline. The lookup and
the batched registration and renewal scripts are multi-key, which Redis Cluster allows only
within one slot, and buckets deliberately spread over slots: a cluster variant swaps the
client (``_make_client``, ``_scan``) and sets ``_single_key`` so that each of them becomes a
pipeline of single-key commands.
"""

from __future__ import annotations

import functools
import logging
import re
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis import exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ..errors import ConfigError, IndexBackendError, IndexUnavailableError
from ..urls import redact_url
from .base import DEFAULT_TTL_SECONDS, EntryRecord, Index, IndexEntry, leading_run
from .deferred import Deferred

log = logging.getLogger("kvcloud.index")

T = TypeVar("T")

DEFAULT_PREFIX = "kvc"
_SCAN_COUNT = 1000

# A value is valid when its format byte is 1 and it is long enough to hold the fixed part;
# its expiry (unix seconds, a double) sits at byte 2. Anything else is garbage: a lookup
# returns it (the client logs it and treats it as a miss) and a registration overwrites it.
_LUA_HELPERS = """
local function live(v, now)
  if not v then return false end
  local form = string.byte(v, 1)
  if form == 2 then return #v >= 22 end
  if form ~= 1 or #v < 30 then return false end
  return struct.unpack('<d', v, 2) > now
end
local function key_at(v)
  if string.byte(v, 1) == 2 then return 22 end
  return 30
end
local function keep_bucket(k, ttl)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
local function sweep(k, now)
  local all = redis.call('HGETALL', k)
  for j = 1, #all, 2 do
    if not live(all[j + 1], now) then redis.call('HDEL', k, all[j]) end
  end
end
"""

# The request path. KEYS[i] is the bucket of the i-th fingerprint; ARGV[1] is now, ARGV[2]
# '1' to stop at the first miss (only the hit run comes back) or '0' for every entry (false
# for a miss). The fields: when ARGV[3] is a width w > 0, ARGV[4] holds them all, w bytes
# each (one argument instead of a hundred: Redis parses and Lua copies each argument, and
# that cost as much as the walk); when it is '0', field i is ARGV[i + 3]. Never writes.
_LOOKUP_SCRIPT = """
local now = tonumber(ARGV[1])
local walk = ARGV[2] == '1'
local w = tonumber(ARGV[3])
local blob = ARGV[4]
local out = {}
for i = 1, #KEYS do
  local f
  if w > 0 then f = string.sub(blob, w * i - w + 1, w * i) else f = ARGV[i + 3] end
  local v = redis.call('HGET', KEYS[i], f)
  if v and #v >= 30 and string.byte(v, 1) == 1 and struct.unpack('<d', v, 2) <= now then
    v = false
  end
  if not v then
    if walk then break end
    v = false
  end
  out[i] = v
end
return out
"""

# SET NX per entry: KEYS[i] and ARGV[2i + 2], ARGV[2i + 3] are the bucket, field and value of
# the i-th entry; ARGV[1] now, ARGV[2] the TTL in ms, ARGV[3] '1' for field TTL (format 2
# values: HSET clears a field's TTL, so HPEXPIRE follows it). An expired or garbage value
# counts as absent. Every 32nd new field of a bucket sweeps the bucket's expired fields, so a
# bucket that keeps receiving entries cannot keep dead ones forever (with field TTL the
# server removes its own; the sweep finds value-expiry entries written before a switch).
_REGISTER_SCRIPT = (
    _LUA_HELPERS
    + """
local now, ttl, field_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
local out = {}
for i = 1, #KEYS do
  local k, f = KEYS[i], ARGV[2 * i + 2]
  if live(redis.call('HGET', k, f), now) then
    out[i] = 0
  else
    local new = redis.call('HSET', k, f, ARGV[2 * i + 3]) == 1
    if field_ttl then redis.call('HPEXPIRE', k, ttl, 'FIELDS', 1, f) end
    if new and redis.call('HLEN', k) % 32 == 0 then sweep(k, now) end
    keep_bucket(k, ttl)
    out[i] = 1
  end
end
return out
"""
)

# Sliding TTL, from the background thread: KEYS[i] and ARGV[i + 3] are a bucket and a field;
# ARGV[1] now, ARGV[2] the new expiry, ARGV[3] the TTL in ms. Only a live value is rewritten,
# and only forwards, so a late renewal never resurrects an entry deleted or expired meanwhile.
# A field-TTL value (format 2, only on servers that have HPEXPIRE) gets HPEXPIRE GT: a field
# that is gone stays gone.
_RENEW_SCRIPT = (
    _LUA_HELPERS
    + """
local now, new, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = 0
for i = 1, #KEYS do
  local k, f = KEYS[i], ARGV[i + 3]
  local v = redis.call('HGET', k, f)
  if v and string.byte(v, 1) == 2 then
    if redis.call('HPEXPIRE', k, ttl, 'GT', 'FIELDS', 1, f)[1] == 1 then
      keep_bucket(k, ttl)
      n = n + 1
    end
  elseif live(v, now) and struct.unpack('<d', v, 2) < new then
    redis.call('HSET', k, f, string.sub(v, 1, 1) .. struct.pack('<d', new) .. string.sub(v, 10))
    keep_bucket(k, ttl)
    n = n + 1
  end
end
return n
"""
)

# Compare-and-delete in one atomic step: KEYS[1] the bucket, ARGV[1] now, ARGV[2] the field,
# ARGV[3] the packed object key the caller verified ('' for any). A concurrent
# re-registration to a new object is never lost.
_DROP_SCRIPT = (
    _LUA_HELPERS
    + """
local v = redis.call('HGET', KEYS[1], ARGV[2])
if not v then return 0 end
if live(v, tonumber(ARGV[1])) then
  if ARGV[3] ~= '' and string.sub(v, key_at(v)) ~= ARGV[3] then return 0 end
elseif ARGV[3] ~= '' or (#v >= 30 and string.byte(v, 1) == 1) then
  return 0
end
return redis.call('HDEL', KEYS[1], ARGV[2])
"""
)

# Compare-and-delete of an entry in the layout before 0.13 (one msgpack string per entry).
_LEGACY_DROP_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, entry = pcall(cmsgpack.unpack, raw)
if not ok or type(entry) ~= 'table' or entry[1] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# Entries registered or renewed per script call: bounds how long one call keeps the
# (single-threaded) server busy.
_WRITE_BATCH = 512
# Decoded entries kept by their packed bytes (expiry excluded). Entries are immutable values,
# the same prefixes are looked up again and again (system prompts, continued sessions), and
# building the frozen IndexEntry costs more than the round trip's share per entry. ~0.5 KB an
# entry.
_DECODE_CACHE_SIZE = 8192
DEFAULT_BUCKETS = 4096
_MAX_BUCKETS = 1 << 24

# The value: format (1), expires_at, created, n_tokens, size, then the object key: a form
# byte and either the 32-byte digest of a standard key (<ns>/<d[:2]>/<d>[.b3|.b3l]) or the key as
# UTF-8 (any other key, e.g. one written by a custom client). Format 2 (field TTL) is the
# same without expires_at.
_HEAD = struct.Struct("<BddIQ")
_HEAD2 = struct.Struct("<BdIQ")
_EXPIRES = struct.Struct("<d")
_FORMAT = 1
_FORMAT_FIELD_TTL = 2
# Hits whose field TTL this process renewed lately, so it renews each at most once per
# renewal interval (a field-TTL value does not say when it expires); ~150 bytes an item.
_RENEWED_MEMO = 1 << 16
_KEY_RAW, _KEY_BLAKE3, _KEY_SHA256, _KEY_BLAKE3_LAYERS = 0, 1, 2, 3
# the digest forms of standard keys (segment.py), longest suffix first
_SUFFIX_FORMS = {".b3l": _KEY_BLAKE3_LAYERS, ".b3": _KEY_BLAKE3}
_FORM_SUFFIXES = {_KEY_BLAKE3_LAYERS: ".b3l", _KEY_BLAKE3: ".b3", _KEY_SHA256: ""}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEXES = re.compile(r"(?:[0-9a-f]{64})*")
# A hex fingerprint's field is its 32 raw bytes; any other field has another length.
_FP_BYTES = 32
_FP_WIDTH = str(_FP_BYTES)
# Bucket names are looked up in a per-namespace table (formatting 128 names per lookup cost
# as much as the rest of the client side) when there are at most this many buckets...
_NAME_TABLE_MAX = 1 << 14
# ...for this many namespaces at a time (a table of 4,096 names is ~0.35 MB, of the most
# allowed ~1.4 MB).
_NAME_TABLES = 4


def _pack_key(ns: str, key: str) -> bytes:
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


def _pack_value(ns: str, entry: IndexEntry, expires_at: float | None) -> bytes:
    """Format 1 with ``expires_at``; format 2 (field TTL: the server keeps the expiry) when it
    is None."""
    if expires_at is None:
        head = _HEAD2.pack(_FORMAT_FIELD_TTL, entry.created, entry.n_tokens, entry.size)
    else:
        head = _HEAD.pack(_FORMAT, expires_at, entry.created, entry.n_tokens, entry.size)
    return head + _pack_key(ns, entry.object_key)


@functools.lru_cache(maxsize=_DECODE_CACHE_SIZE)
def _unpack_cached(ns: str, body: bytes) -> IndexEntry:
    # body is the value from `created` on; lru_cache never caches an exception, so
    # undecodable values are reported every time.
    created, n_tokens, size = struct.unpack_from("<dIQ", body)
    return IndexEntry(_unpack_key(ns, body[20:]), n_tokens, size, created)


def _unpack_value(ns: str, raw: bytes) -> tuple[IndexEntry, float | None]:
    """(entry, expires_at) of a stored value, expires_at None for a field-TTL value (the
    server holds it); ValueError for anything else."""
    if len(raw) > _HEAD.size and raw[0] == _FORMAT:
        return _unpack_cached(ns, raw[9:]), _EXPIRES.unpack_from(raw, 1)[0]
    if len(raw) > _HEAD2.size and raw[0] == _FORMAT_FIELD_TTL:
        return _unpack_cached(ns, raw[1:]), None
    raise ValueError(f"not an index entry value ({len(raw)} bytes)")


def _field(fp: str) -> bytes:
    """The hash field of a fingerprint: its 32 bytes for a (lowercase) hex fingerprint, else
    its UTF-8 followed by 0xff (never in UTF-8), padded so it is never 32 bytes long."""
    if _HEX64.fullmatch(fp):
        return bytes.fromhex(fp)
    raw = fp.encode("utf-8") + b"\xff"
    return raw + b"\xff" if len(raw) == 32 else raw


def _fields(fps: list[str]) -> tuple[list[bytes], bytes | None]:
    """_field of every fp and, when all are hex fingerprints (one fromhex for the lot), those
    32-byte fields joined (None otherwise): what the lookup script takes as one argument."""
    joined = "".join(fps)
    if len(joined) == 64 * len(fps) and _HEXES.fullmatch(joined):
        raw = bytes.fromhex(joined)
        return [raw[i : i + _FP_BYTES] for i in range(0, len(raw), _FP_BYTES)], raw
    return [_field(fp) for fp in fps], None


def _fp_of_field(field: bytes) -> str:
    if len(field) == 32:
        return field.hex()
    return field[: field.index(b"\xff")].decode("utf-8")


class _Retry(Retry):
    """redis-py's Retry, minus retries of authentication failures.

    Those are ConnectionError subclasses, but a wrong password stays wrong, so retrying
    only delays the error.
    """

    def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (rexc.AuthenticationError, rexc.AuthorizationError)):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def default_retry() -> Retry:
    # Connection errors only: a timeout already cost socket_timeout, and repeating it would
    # multiply the wait of a caller that is about to fall back to recompute. Backoff sleeps
    # are 0.1 + 0.2 + 0.4 s, so a refused connection fails in well under a second or two.
    return _Retry(
        ExponentialBackoff(cap=0.4, base=0.05), retries=3, supported_errors=(rexc.ConnectionError,)
    )


def _component(value: str) -> str:
    """Percent-encode one key component: no ':', glob characters, braces or '%' survive."""
    return quote(value, safe="")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _text(key: bytes | str) -> str:
    return key.decode("utf-8") if isinstance(key, bytes) else key


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class RedisIndex(Index):
    """Index in Redis (``redis://`` or TLS ``rediss://``).

    URL: ``redis://[user:password@]host:port/db?prefix=kvc&ttl=604800&buckets=4096``.
    ``prefix``, ``ttl`` (seconds; overrides ``ttl_seconds`` when present), ``buckets``
    (hashes per namespace, a power of two: about the namespace's entries ÷ 50; every worker of
    a fleet must use the same value) and ``field_ttl`` (``auto``, ``on`` or ``off``: per-entry
    TTL in the hash fields where the server has it, see the module docstring) are kvcloud's
    own options; any other query option is passed to redis-py (e.g. ``ssl_ca_certs`` for
    rediss://).

    ``lookup`` and ``lookup_run`` are one EVALSHA; the sliding-TTL renewal of their hits and
    their ``counters`` are sent by a background thread ``renew_delay`` seconds later (batched
    with the lookups of that window), so they may lag a lookup by that much plus a round trip.
    ``counters()`` and ``close()`` send whatever is pending first, so a process reads its own
    increments and a clean close loses none.
    """

    #: Cluster variants: every multi-key script becomes a pipeline of single-key commands.
    _single_key = False

    scheme_names: tuple[str, ...] = ("redis", "rediss")

    def __init__(
        self,
        url: str,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        *,
        prefix: str | None = None,
        socket_connect_timeout: float = 2.0,
        socket_timeout: float = 5.0,
        health_check_interval: int = 30,
        retry: Retry | None = None,
        renew_delay: float = 0.05,
        buckets: int | None = None,
        field_ttl: str | None = None,
    ) -> None:
        self.url = redact_url(url)
        try:
            parts = urlsplit(url)
            password = parts.password
        except ValueError as exc:
            raise ConfigError(f"malformed index URL {self.url!r}: {exc}") from None
        if parts.scheme.lower() not in self.scheme_names:
            raise ConfigError(
                f"{type(self).__name__} needs a {' or '.join(s + '://' for s in self.scheme_names)}"
                f" URL, got {self.url!r}"
            )
        # Strings to scrub from error messages, in case a library ever echoes them.
        self._secrets = [s for s in (password, unquote(password or "")) if s]

        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        prefix = options.pop("prefix", prefix if prefix is not None else DEFAULT_PREFIX)
        if "ttl" in options:
            raw_ttl = options.pop("ttl")
            try:
                ttl_seconds = int(raw_ttl)
            except ValueError:
                raise ConfigError(f"index URL {self.url!r}: ttl must be an integer") from None
        raw_buckets = options.pop("buckets", buckets if buckets is not None else DEFAULT_BUCKETS)
        try:
            n_buckets = int(raw_buckets)
        except ValueError:
            raise ConfigError(f"index URL {self.url!r}: buckets must be an integer") from None
        if not 1 <= n_buckets <= _MAX_BUCKETS or n_buckets & (n_buckets - 1):
            raise ConfigError(
                f"index URL {self.url!r}: buckets must be a power of two from 1 to {_MAX_BUCKETS}"
            )
        self.buckets = n_buckets
        mode = options.pop("field_ttl", field_ttl if field_ttl is not None else "auto").lower()
        if mode not in ("auto", "on", "off"):
            raise ConfigError(f"index URL {self.url!r}: field_ttl must be auto, on or off")
        self.field_ttl_mode = mode
        # decided on the first write (it takes a round trip); "off" needs none
        self._field_ttl: bool | None = False if mode == "off" else None
        super().__init__(ttl_seconds)
        if self.ttl_seconds <= 0:
            raise ConfigError(f"index URL {self.url!r}: ttl must be positive")
        if not prefix or "{" in prefix or "}" in prefix:
            # Braces would form a Redis Cluster hash tag and pin every key to one slot.
            raise ConfigError(f"index URL {self.url!r}: prefix must be non-empty, without braces")
        self.prefix = prefix
        self._ttl_ms = self.ttl_seconds * 1000
        self._counters_key = f"{prefix}:counters"
        self._name_tables: dict[str, list[str]] = {}
        self._name_lock = threading.Lock()
        self._renewed: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._renewed_lock = threading.Lock()
        self._renew_every = min(self.ttl_seconds / 100, 60.0)

        client_url = urlunsplit(parts._replace(query=urlencode(options)))
        try:
            self._client = self._make_client(
                client_url,
                socket_connect_timeout=socket_connect_timeout,
                socket_timeout=socket_timeout,
                health_check_interval=health_check_interval,
                retry=retry if retry is not None else default_retry(),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"index URL {self.url!r}: {self._scrub(str(exc))}") from None
        self._sources = {
            "lookup": _LOOKUP_SCRIPT,
            "register": _REGISTER_SCRIPT,
            "renew": _RENEW_SCRIPT,
            "drop": _DROP_SCRIPT,
            "legacy_drop": _LEGACY_DROP_SCRIPT,
        }
        self._scripts = {n: self._client.register_script(s) for n, s in self._sources.items()}
        self._deferred = Deferred(
            self._write_side_effects, f"kvcloud-index-{self.prefix}", delay=renew_delay
        )
        # An index dropped without close(): its thread need not idle on until _IDLE_EXIT.
        weakref.finalize(self, self._deferred.stop)
        # How long close() and counters() wait for pending side effects: one attempt of the
        # background thread, connection included.
        self._flush_timeout = float(socket_connect_timeout) + float(socket_timeout) + 1.0

    # -- hooks a cluster variant overrides --------------------------------------------------

    def _make_client(self, url: str, **kwargs: Any) -> Any:
        return redis.Redis.from_url(url, **kwargs)

    def _scan(self, pattern: str) -> Iterator[bytes]:
        return self._client.scan_iter(match=pattern, count=_SCAN_COUNT)

    def _script(self, name: str, keys: Sequence[str], args: Sequence[Any], pipe: Any = None) -> Any:
        if pipe is None:
            return self._scripts[name](keys=list(keys), args=list(args))
        if self._single_key:
            # A cluster pipeline cannot load a script on the node it lands on: send the source
            # (off the request path, so its few hundred bytes do not matter).
            return pipe.execute_command("EVAL", self._sources[name], len(keys), *keys, *args)
        # EVALSHA by hand: a pipeline given Script objects asks SCRIPT EXISTS first, which is
        # a second round trip every time; _execute loads them when the server says NOSCRIPT.
        sha = self._scripts[name].sha
        return pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    def _execute(self, build: Callable[[Any, bool], None]) -> list[Any]:
        """Run the pipeline ``build(pipe, first)`` fills, in one round trip. If the server has
        lost the scripts (restart, SCRIPT FLUSH), load them and run it once more with
        ``first`` False: every EVALSHA failed then, but any other command in it ran."""
        for first in (True, False):
            pipe = self._client.pipeline(transaction=False)
            build(pipe, first)
            if not len(pipe):
                return []
            try:
                return pipe.execute()
            except rexc.NoScriptError:
                if not first:
                    raise
                for script in self._scripts.values():
                    script.sha = self._client.script_load(script.script)
        raise AssertionError("unreachable")

    def _read_entries(
        self, buckets: list[str], fields: list[bytes], packed: bytes | None, walk: bool
    ) -> list[bytes | None]:
        """The request path: the raw values of (bucket, field) pairs in one round trip,
        stopping at the first miss when ``walk``; ``packed`` is the fields joined when all
        are 32 bytes (see _fields). Expired values come back as misses; TTLs are not
        renewed here (see _write_side_effects)."""
        now = time.time()
        if not self._single_key:
            flag = "1" if walk else "0"
            if packed is not None:
                args = [repr(now), flag, _FP_WIDTH, packed]
            else:
                args = [repr(now), flag, "0", *fields]
            return self._script("lookup", buckets, args)
        # One slot per command (Redis Cluster): a pipeline of HGETs, which redis-py sends to
        # every node involved before reading any reply; the expiry is checked here.
        pipe = self._client.pipeline(transaction=False)
        for bucket, field in zip(buckets, fields, strict=True):
            pipe.hget(bucket, field)
        raws: list[bytes | None] = []
        for raw in pipe.execute():
            if (
                raw is not None
                and len(raw) > _HEAD.size
                and raw[0] == _FORMAT
                and _EXPIRES.unpack_from(raw, 1)[0] <= now
            ):
                raw = None
            if raw is None and walk:
                break
            raws.append(raw)
        return raws

    def _run_batches(
        self, name: str, keys: list[str], head: list[Any], per_key: list[list[Any]]
    ) -> list[Any]:
        """Run a per-entry script over many entries: one EVALSHA per _WRITE_BATCH entries,
        all in one pipeline (one round trip); one single-key script each on a cluster."""
        step = 1 if self._single_key else _WRITE_BATCH

        def build(pipe: Any, first: bool) -> None:
            for i in range(0, len(keys), step):
                args = [*head, *(a for group in per_key[i : i + step] for a in group)]
                self._script(name, keys[i : i + step], args, pipe)

        replies = self._execute(build)
        return [r for reply in replies for r in (reply if isinstance(reply, list) else [reply])]

    def _write_side_effects(self, items: list[Any], counters: dict[str, int]) -> None:
        """Background thread: slide the expiry of ``items`` ((bucket, field) pairs of lookup
        hits) and add ``counters``, in one pipeline."""
        now = time.time()
        step = 1 if self._single_key else _WRITE_BATCH
        head = [repr(now), repr(now + self.ttl_seconds), self._ttl_ms]

        def build(pipe: Any, first: bool) -> None:
            for i in range(0, len(items), step):
                batch = items[i : i + step]
                self._script("renew", [b for b, _ in batch], [*head, *(f for _, f in batch)], pipe)
            if first:  # a retry after NOSCRIPT: the increments already went in
                for name, n in counters.items():
                    pipe.hincrby(self._counters_key, name, int(n))

        with self._errors():
            self._execute(build)

    # -- keys and errors --------------------------------------------------------------------

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
        text = _text(key)
        head = f"{self.prefix}:{kind}:"
        if not text.startswith(head):
            return None
        first, sep, second = text[len(head) :].partition(":")
        if not sep or ":" in second:
            return None  # not written by us
        return unquote(first), unquote(second)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (rexc.AuthenticationError, rexc.AuthorizationError) as exc:
            raise IndexUnavailableError(
                f"redis index {self.url}: authentication failed ({self._scrub(str(exc))}); "
                "check the user name and password in the index URL (KVCLOUD_INDEX)"
            ) from exc
        except (rexc.ConnectionError, rexc.TimeoutError) as exc:
            raise IndexUnavailableError(
                f"redis index {self.url} is unreachable ({type(exc).__name__}: "
                f"{self._scrub(str(exc))}); check that redis-server is running and reachable "
                "at that host and port (firewall, TLS: rediss:// vs redis://) and that it "
                "is not overloaded"
            ) from exc
        except rexc.RedisError as exc:
            raise IndexBackendError(
                f"redis index {self.url}: {type(exc).__name__}: {self._scrub(str(exc))}"
            ) from exc

    # -- entries ----------------------------------------------------------------------------

    def register(self, ns: str, fp: str, entry: IndexEntry) -> bool:
        return self.register_many(ns, [(fp, entry)])[0]

    def register_many(self, ns: str, entries: Sequence[tuple[str, IndexEntry]]) -> list[bool]:
        entries = list(entries)
        if not entries:
            return []
        with self._errors():
            field_ttl = self.uses_field_ttl()
        now = time.time()
        fields, _ = _fields([fp for fp, _ in entries])
        expires_at = None if field_ttl else now + self.ttl_seconds
        per_entry = [
            [field, _pack_value(ns, entry, expires_at)]
            for field, (_, entry) in zip(fields, entries, strict=True)
        ]
        head = [repr(now), self._ttl_ms, "1" if field_ttl else "0"]
        with self._errors():
            replies = self._run_batches("register", self._buckets(ns, fields), head, per_entry)
        return [bool(r) for r in replies]

    def uses_field_ttl(self) -> bool:
        """Whether this index writes per-field TTLs: ``field_ttl=on``, or ``auto`` on a Redis
        that has ``HPEXPIRE`` (asked once: two round trips on the first write)."""
        if self._field_ttl is None:
            try:
                self._client.execute_command("HPTTL", f"{self.prefix}:probe", "FIELDS", 1, "probe")
                supported = True
            except (rexc.ConnectionError, rexc.TimeoutError):
                raise
            except rexc.RedisError:
                # unknown command (Redis before 7.4, Valkey before 9), said by the server or,
                # on a cluster, by redis-py from the server's command table
                supported = False
            if self.field_ttl_mode == "on" and not supported:
                raise IndexBackendError(
                    f"redis index {self.url}: field_ttl=on, but the server has no hash-field "
                    "expiry (HPEXPIRE: Redis 7.4+, Valkey 9+); use field_ttl=auto or off"
                )
            reason = "the server has no hash-field expiry"
            if supported and self.field_ttl_mode == "auto" and self._server_is_valkey():
                supported = False
                reason = "Valkey keeps hashes with field TTLs in a larger encoding"
            self._field_ttl = supported
            log.info(
                "redis index %s: %s",
                self.url,
                "per-entry TTL in hash fields (HPEXPIRE)"
                if supported
                else f"expiry kept in each entry ({reason}; URL option field_ttl)",
            )
        return self._field_ttl

    def _server_is_valkey(self) -> bool:
        info = self._client.info("server")
        if info and all(isinstance(v, dict) for v in info.values()):
            info = next(iter(info.values()))  # a cluster answers per node
        return "valkey_version" in info or str(info.get("server_name", "")).lower() == "valkey"

    def lookup(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry | None]:
        fps = list(fps)
        return self._lookup(ns, fps, counters, walk=False)

    def lookup_run(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry]:
        # Values the script returned but that do not decode end the run too.
        return leading_run(self._lookup(ns, list(fps), counters, walk=True))

    def _lookup(
        self, ns: str, fps: list[str], counters: Mapping[str, int] | None, walk: bool
    ) -> list[IndexEntry | None]:
        if not fps:
            if counters:
                self._deferred.submit((), counters)
            return []
        fields, packed = _fields(fps)
        buckets = self._buckets(ns, fields)
        # The request path is this one round trip. The TTL renewal of the hits and the
        # counters go to the background thread, and only once the read succeeded: when it
        # raises, the caller still owns its counters (KVCloud puts them back for later).
        with self._errors():
            raws = self._read_entries(buckets, fields, packed, walk)
        if len(raws) > len(fps) or (not walk and len(raws) != len(fps)):
            raise IndexBackendError(
                f"redis index {self.url}: {len(raws)} values for {len(fps)} fingerprints"
            )
        found: list[IndexEntry | None] = []
        renew: list[tuple[str, bytes]] = []
        fresh = self.renewal_due(time.time())
        for i, raw in enumerate(raws):
            if raw is None:
                found.append(None)
                continue
            try:
                entry, expires_at = _unpack_value(ns, raw)
            except Exception as exc:  # any garbage value: the index is only a hint
                log.warning(
                    "redis index: undecodable entry %s:%s treated as a miss: %s", ns, fps[i], exc
                )
                found.append(None)
                continue
            found.append(entry)
            if expires_at is None:
                if self._renewal_due((buckets[i], fields[i])):
                    renew.append((buckets[i], fields[i]))
            elif expires_at < fresh:
                renew.append((buckets[i], fields[i]))
        if not walk:
            found.extend([None] * (len(fps) - len(found)))
        if renew or counters:
            self._deferred.submit(renew, counters)
        return found

    def _renewal_due(self, item: tuple[str, bytes]) -> bool:
        """For a field-TTL hit, whose value does not say when it expires: renew it unless this
        process did within the renewal interval (the same resolution as value expiry's)."""
        now = time.monotonic()
        with self._renewed_lock:
            last = self._renewed.get(item)
            if last is not None and now - last < self._renew_every:
                return False
            self._renewed[item] = now
            self._renewed.move_to_end(item)
            if len(self._renewed) > _RENEWED_MEMO:
                self._renewed.popitem(last=False)
        return True

    def drop(self, ns: str, fp: str, object_key: str | None = None) -> bool:
        field = _field(fp)
        expected = b"" if object_key is None else _pack_key(ns, object_key)
        (bucket,) = self._buckets(ns, [field])
        with self._errors():
            if self._script("drop", [bucket], [repr(time.time()), field, expected]):
                return True
            # An entry of the layout before 0.13, until those have expired.
            legacy = self._legacy_key(ns, fp)
            if object_key is None:
                return bool(self._client.delete(legacy))
            return bool(self._script("legacy_drop", [legacy], [object_key]))

    def _patterns(self, ns: str | None) -> tuple[str, str]:
        scope = "*" if ns is None else _glob_escape(_component(ns)) + ":*"
        head = _glob_escape(self.prefix)
        return f"{head}:h:{scope}", f"{head}:e:{scope}"

    def iter_entries(self, ns: str | None = None) -> Iterator[EntryRecord]:
        buckets, legacy = self._patterns(ns)
        seen: set[bytes] = set()  # SCAN may repeat a key while the table rehashes
        with self._errors():
            for keys in _batched(self._scan(buckets), _SCAN_COUNT):
                keys = [k for k in keys if k not in seen]
                seen.update(keys)
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.hgetall(key)
                now = time.time()
                hashes = pipe.execute()
                ttls = self._field_ttls(keys, hashes)
                for key, fields in zip(keys, hashes, strict=True):
                    parts = self._split_key(key, "h")
                    if parts is None:
                        continue  # not written by us
                    for field, raw in fields.items():
                        record = self._record(parts[0], field, raw, now, ttls.get((key, field)))
                        if record is not None:
                            yield record
            yield from self._iter_legacy(legacy)

    def _field_ttls(
        self, keys: list[bytes], hashes: list[dict[bytes, bytes]]
    ) -> dict[tuple[bytes, bytes], int]:
        """The TTL (ms; -1 none, -2 gone) of every field-TTL value among ``hashes``, one
        pipelined HPTTL per bucket that holds any (off the request path: stats, gc, verify)."""
        wanted = [
            (key, [f for f, raw in fields.items() if raw[:1] == b"\x02"])
            for key, fields in zip(keys, hashes, strict=True)
        ]
        wanted = [(key, fields) for key, fields in wanted if fields]
        if not wanted:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key, fields in wanted:
            pipe.execute_command("HPTTL", key, "FIELDS", len(fields), *fields)
        out: dict[tuple[bytes, bytes], int] = {}
        for (key, fields), reply in zip(wanted, pipe.execute(), strict=True):
            for field, ms in zip(fields, reply, strict=True):
                out[(key, field)] = int(ms)
        return out

    def _record(
        self, ns: str, field: bytes, raw: bytes, now: float, field_ttl_ms: int | None = None
    ) -> EntryRecord | None:
        try:
            fp = _fp_of_field(field)
            entry, expires_at = _unpack_value(ns, raw)
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

    def _iter_legacy(self, pattern: str) -> Iterator[EntryRecord]:
        for keys in _batched(self._scan(pattern), _SCAN_COUNT):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            replies = pipe.execute()
            now = time.time()
            for i, key in enumerate(keys):
                raw, pttl = replies[2 * i], replies[2 * i + 1]
                parts = self._split_key(key, "e")
                if raw is None or parts is None:
                    continue  # expired or deleted since SCAN saw it
                try:
                    entry = IndexEntry.unpack(raw)
                except Exception as exc:
                    log.warning("redis index: undecodable entry %s skipped: %s", _text(key), exc)
                    continue
                expires_at = now + pttl / 1000 if pttl is not None and pttl >= 0 else None
                yield EntryRecord(ns=parts[0], fp=parts[1], entry=entry, expires_at=expires_at)

    def count_entries(self, ns: str | None = None) -> int:
        return sum(1 for _ in self.iter_entries(ns))

    # -- sessions ---------------------------------------------------------------------------

    def put_session(
        self, scope: str, session_id: str, record: bytes, ttl_seconds: int | None = None
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive (or None for no expiry)")
        key = self._session_key(scope, session_id)
        px = None if ttl_seconds is None else int(ttl_seconds * 1000)
        with self._errors():
            # A plain SET also clears any TTL an earlier version of the record had.
            self._client.set(key, bytes(record), px=px)

    def get_session(self, scope: str, session_id: str) -> bytes | None:
        with self._errors():
            raw = self._client.get(self._session_key(scope, session_id))
        return None if raw is None else bytes(raw)

    def delete_session(self, scope: str, session_id: str) -> bool:
        with self._errors():
            return bool(self._client.delete(self._session_key(scope, session_id)))

    def iter_sessions(self) -> Iterator[tuple[str, str, bytes]]:
        pattern = f"{_glob_escape(self.prefix)}:s:*"
        with self._errors():
            for keys in _batched(self._scan(pattern), _SCAN_COUNT):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                for key, raw in zip(keys, pipe.execute(), strict=True):
                    parts = self._split_key(key, "s")
                    if raw is not None and parts is not None:
                        yield parts[0], parts[1], bytes(raw)

    # -- counters and health ----------------------------------------------------------------

    def incr(self, counters: Mapping[str, int]) -> None:
        if not counters:
            return
        pipe = self._client.pipeline(transaction=False)
        for name, n in counters.items():
            pipe.hincrby(self._counters_key, name, int(n))
        with self._errors():
            pipe.execute()

    def counters(self) -> dict[str, int]:
        # Read your own writes: increments given to lookup() may still be queued.
        self._deferred.flush(self._flush_timeout)
        with self._errors():
            raw = self._client.hgetall(self._counters_key)
        return {_text(k): int(v) for k, v in raw.items()}

    def ping(self) -> float:
        start = time.perf_counter()
        with self._errors():
            self._client.ping()
        return max(time.perf_counter() - start, 1e-9)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the TTL renewals and counters of earlier lookups were sent (or failed);
        False if that took longer than ``timeout`` (default: one connect + one reply)."""
        return self._deferred.flush(self._flush_timeout if timeout is None else timeout)

    def close(self) -> None:
        # Pending counters are sent first, so a clean close never loses them.
        try:
            self._deferred.close(self._flush_timeout)
        finally:
            try:
                self._client.close()
            except rexc.RedisError as exc:
                log.debug("redis index %s: close: %s", self.url, exc)


__all__ = ["DEFAULT_PREFIX", "RedisIndex", "default_retry"]
