"""Redis index: the shared index for many workers on many machines.

This module is the connection (client, retries, URL options, errors) and the Index methods
on top of it. Where entries live and how they are encoded (buckets, value formats, expiry):
:mod:`.redis_layout`; the Lua scripts that read and write them: :mod:`.redis_scripts`; the
per-namespace bookkeeping that ``summary`` (``kvcloud stats --serve``) reads: :mod:`.redis_stats`.

``field_ttl=auto`` (the default) picks field TTL on Redis 7.4+, and value expiry on Redis 7.0
and on Valkey, whose hashes leave their compact listpack encoding as soon as one field has a
TTL (measured in docs/OPERATIONS.md: 140 bytes an entry against 106; Redis 8 keeps them
compact, 121 against 119). ``field_ttl=on`` forces it wherever the server has ``HPEXPIRE``.
Readers understand both formats on any server, so a fleet can switch while running.

Lookups are one ``EVALSHA`` on the request path (``lookup_run`` returns only the run of hits,
``lookup`` every entry). The TTL renewal of the hits and the counter increments are sent by
one background thread (:class:`Deferred`), ``renew_delay`` (50 ms) later, and only for hits
whose expiry is more than a hundredth of the TTL (at most a minute) old, so a hot prefix costs
a write a minute rather than one per lookup (and gc's least-recently-used order has that
resolution).

Every other operation touches a single key or is a non-transactional pipeline. The lookup and
the batched registration and renewal scripts are multi-key, which Redis Cluster allows only
within one slot, and buckets deliberately spread over slots: a cluster variant swaps the
client (``_make_client``, ``_scan``) and sets ``_single_key`` so that each of them becomes a
pipeline of single-key commands.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis import exceptions as rexc
from redis.retry import Retry

from ..errors import ConfigError, IndexBackendError, IndexUnavailableError
from ..urls import redact_url
from .base import DEFAULT_TTL_SECONDS, EntryRecord, Index, IndexEntry, leading_run
from .deferred import Deferred
from .redis_layout import (
    DEFAULT_BUCKETS,
    DEFAULT_PREFIX,
    FP_WIDTH,
    MAX_BUCKETS,
    KeyLayout,
    as_text,
    entry_field,
    entry_fields,
    entry_record,
    glob_escape,
    is_expired,
    pack_key,
    pack_value,
    unpack_value,
)
from .redis_retry import default_retry
from .redis_scripts import Scripts
from .redis_stats import Bookkeeping, Tally, no_touch_hook

log = logging.getLogger("kvcloud.index")

T = TypeVar("T")

_SCAN_COUNT = 1000
# Hits whose field TTL this process renewed lately, so it renews each at most once per
# renewal interval (a field-TTL value does not say when it expires); ~150 bytes an item.
_RENEWED_MEMO = 1 << 16


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class RedisIndex(Bookkeeping, KeyLayout, Index):
    """Index in Redis (``redis://`` or TLS ``rediss://``).

    URL: ``redis://[user:password@]host:port/db?prefix=kvc&ttl=604800&buckets=4096``.
    ``prefix``, ``ttl`` (seconds; overrides ``ttl_seconds`` when present), ``buckets``
    (hashes per namespace, a power of two: about the namespace's entries ÷ 50; every worker of
    a fleet must use the same value) and ``field_ttl`` (``auto``, ``on`` or ``off``: per-entry
    TTL in the hash fields where the server has it, see the module docstring) are kvcloud's
    own options, and so is ``no_touch`` (``on``: every command runs after ``CLIENT NO-TOUCH
    ON``, so this client's reads leave the keys' LRU/LFU clocks as they were; for stats and
    other tools that must not make what they read look used; Redis 7.2+ and Valkey, a warning
    elsewhere); any other query option is passed to redis-py (e.g. ``ssl_ca_certs`` for
    rediss://).

    ``lookup`` and ``lookup_run`` are one EVALSHA; the sliding-TTL renewal of their hits and
    their ``counters`` are sent by a background thread ``renew_delay`` seconds later (batched
    with the lookups of that window), so they may lag a lookup by that much plus a round trip.
    ``counters()`` and ``close()`` send whatever is pending first, so a process reads its own
    increments and a clean close loses none.
    """

    #: Cluster variants: every multi-key script becomes a pipeline of single-key commands.
    _single_key = False
    #: Whether a connect hook must run the standard handshake itself (a cluster client runs
    #: it before calling the hook).
    _hook_runs_handshake = True

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
        no_touch: bool = False,
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
        if not 1 <= n_buckets <= MAX_BUCKETS or n_buckets & (n_buckets - 1):
            raise ConfigError(
                f"index URL {self.url!r}: buckets must be a power of two from 1 to {MAX_BUCKETS}"
            )
        mode = options.pop("field_ttl", field_ttl if field_ttl is not None else "auto").lower()
        if mode not in ("auto", "on", "off"):
            raise ConfigError(f"index URL {self.url!r}: field_ttl must be auto, on or off")
        self.field_ttl_mode = mode
        untouched = options.pop("no_touch", "on" if no_touch else "off").lower()
        if untouched not in ("on", "off"):
            raise ConfigError(f"index URL {self.url!r}: no_touch must be on or off")
        # decided on the first write (it takes a round trip); "off" needs none
        self._field_ttl: bool | None = False if mode == "off" else None
        Index.__init__(self, ttl_seconds)
        if self.ttl_seconds <= 0:
            raise ConfigError(f"index URL {self.url!r}: ttl must be positive")
        if not prefix or "{" in prefix or "}" in prefix:
            # Braces would form a Redis Cluster hash tag and pin every key to one slot.
            raise ConfigError(f"index URL {self.url!r}: prefix must be non-empty, without braces")
        KeyLayout.__init__(self, prefix, n_buckets)
        self._ttl_ms = self.ttl_seconds * 1000
        self._renewed: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._renewed_lock = threading.Lock()
        self._renew_every = min(self.ttl_seconds / 100, 60.0)

        client_url = urlunsplit(parts._replace(query=urlencode(options)))
        hook = {}
        if untouched == "on":
            hook["redis_connect_func"] = no_touch_hook(self, self._hook_runs_handshake)
        try:
            self._client = self._make_client(
                client_url,
                socket_connect_timeout=socket_connect_timeout,
                socket_timeout=socket_timeout,
                health_check_interval=health_check_interval,
                retry=retry if retry is not None else default_retry(),
                **hook,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"index URL {self.url!r}: {self._scrub(str(exc))}") from None
        self._scripts = Scripts(self._client, self._single_key)
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

    def _read_entries(
        self, buckets: list[str], fields: list[bytes], packed: bytes | None, walk: bool
    ) -> list[bytes | None]:
        """The request path: the raw values of (bucket, field) pairs in one round trip,
        stopping at the first miss when ``walk``; ``packed`` is the fields joined when all
        are 32 bytes (see entry_fields). Expired values come back as misses; TTLs are not
        renewed here (see _write_side_effects)."""
        now = time.time()
        if not self._single_key:
            flag = "1" if walk else "0"
            if packed is not None:
                args = [repr(now), flag, FP_WIDTH, packed]
            else:
                args = [repr(now), flag, "0", *fields]
            return self._scripts.run("lookup", buckets, args)
        # One slot per command (Redis Cluster): a pipeline of HGETs, which redis-py sends to
        # every node involved before reading any reply; the expiry is checked here.
        pipe = self._client.pipeline(transaction=False)
        for bucket, field in zip(buckets, fields, strict=True):
            pipe.hget(bucket, field)
        raws: list[bytes | None] = []
        for raw in pipe.execute():
            if raw is not None and is_expired(raw, now):
                raw = None
            if raw is None and walk:
                break
            raws.append(raw)
        return raws

    def _write_side_effects(self, items: list[Any], counters: dict[Any, int]) -> None:
        """Background thread: slide the expiry of ``items`` ((bucket, field) pairs of lookup
        hits) and add ``counters`` (named counters, and the bookkeeping's tallies), in one
        pipeline; then move the renewed entries in the bookkeeping."""
        now = time.time()
        step = self._scripts.step
        head = [repr(now), repr(now + self.ttl_seconds), self._ttl_ms]

        def build(pipe: Any, first: bool) -> None:
            for i in range(0, len(items), step):
                batch = items[i : i + step]
                self._scripts.run(
                    "renew", [b for b, _ in batch], [*head, *(f for _, f in batch)], pipe
                )
            if first:  # a retry after NOSCRIPT: the increments already went in
                tallies = {}
                for name, n in counters.items():
                    if isinstance(name, Tally):
                        tallies[name] = n
                    else:
                        pipe.hincrby(self._counters_key, name, int(n))
                self._write_tallies(pipe, tallies, now)

        with self._errors():
            replies = self._scripts.execute(build)
        self._tally_renewed(items, replies[: -(-len(items) // step)], now)

    # -- errors -----------------------------------------------------------------------------

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
        fields, _ = entry_fields([fp for fp, _ in entries])
        expires_at = None if field_ttl else now + self.ttl_seconds
        per_entry = [
            [field, pack_value(ns, entry, expires_at)]
            for field, (_, entry) in zip(fields, entries, strict=True)
        ]
        head = [repr(now), self._ttl_ms, "1" if field_ttl else "0"]
        with self._errors():
            replies = self._scripts.run_batches(
                "register", self._buckets(ns, fields), head, per_entry
            )
        created = [bool(r) for r in replies]
        self._tally_registered(ns, entries, created, now)
        return created

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
        self,
        ns: str,
        fps: Sequence[str],
        counters: Mapping[str, int] | None = None,
        *,
        renew: bool = True,
    ) -> list[IndexEntry | None]:
        fps = list(fps)
        return self._lookup(ns, fps, counters, walk=False, renew=renew)

    def lookup_run(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry]:
        # Values the script returned but that do not decode end the run too.
        return leading_run(self._lookup(ns, list(fps), counters, walk=True))

    def _lookup(
        self,
        ns: str,
        fps: list[str],
        counters: Mapping[str, int] | None,
        walk: bool,
        renew: bool = True,
    ) -> list[IndexEntry | None]:
        if not fps:
            if counters:
                self._deferred.submit((), counters)
            return []
        fields, packed = entry_fields(fps)
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
        renewals: list[tuple[str, bytes]] = []
        fresh = self.renewal_due(time.time())
        for i, raw in enumerate(raws):
            if raw is None:
                found.append(None)
                continue
            try:
                entry, expires_at = unpack_value(ns, raw)
            except Exception as exc:  # any garbage value: the index is only a hint
                log.warning(
                    "redis index: undecodable entry %s:%s treated as a miss: %s", ns, fps[i], exc
                )
                found.append(None)
                continue
            found.append(entry)
            if not renew:
                continue
            if expires_at is None:
                if self._renewal_due((buckets[i], fields[i])):
                    renewals.append((buckets[i], fields[i]))
            elif expires_at < fresh:
                renewals.append((buckets[i], fields[i]))
        if not walk:
            found.extend([None] * (len(fps) - len(found)))
        if renewals or counters:
            self._deferred.submit(renewals, counters)
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
        field = entry_field(fp)
        expected = b"" if object_key is None else pack_key(ns, object_key)
        (bucket,) = self._buckets(ns, [field])
        with self._errors():
            dropped = self._scripts.run("drop", [bucket], [repr(time.time()), field, expected])
            if dropped:
                self._tally_dropped(ns, dropped)
                return True
            # An entry of the layout before 0.13, until those have expired.
            legacy = self._legacy_key(ns, fp)
            if object_key is None:
                return bool(self._client.delete(legacy))
            return bool(self._scripts.run("legacy_drop", [legacy], [object_key]))

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
                        record = entry_record(parts[0], field, raw, now, ttls.get((key, field)))
                        if record is not None:
                            yield record
            yield from self._iter_legacy(legacy)

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
                    log.warning("redis index: undecodable entry %s skipped: %s", as_text(key), exc)
                    continue
                expires_at = now + pttl / 1000 if pttl is not None and pttl >= 0 else None
                yield EntryRecord(ns=parts[0], fp=parts[1], entry=entry, expires_at=expires_at)

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
        pattern = f"{glob_escape(self.prefix)}:s:*"
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
        return {as_text(k): int(v) for k, v in raw.items()}

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


__all__ = ["RedisIndex", "default_retry"]
