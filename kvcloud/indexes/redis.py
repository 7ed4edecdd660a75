"""Redis index: the shared index for many workers on many machines.

Key schema (``prefix`` defaults to ``kvc``)::

    {prefix}:e:{ns}:{fp}                 entry, value = IndexEntry.pack(), sliding TTL
    {prefix}:s:{scope}:{session_id}      session record, optional TTL
    {prefix}:counters                    hash of named counters

Every key component is percent-encoded (:func:`_component`), so a ``:`` or glob character in
a tenant-controlled string cannot reach another tenant's key or widen a SCAN pattern. Entry
keys carry no hash tag on purpose: in Redis Cluster they must spread over slots by
fingerprint rather than pin a whole namespace to one node.

Lookups are one ``MGET`` on the request path: one command whose packing and reply parsing are
cheap (in C with hiredis), where a pipeline of 128 ``GETEX`` spends most of its time building
and parsing 128 commands in Python. What ``GETEX`` did on the side — sliding the TTL of the
hits — and the counter increments are sent by one background thread (:class:`_Deferred`),
``renew_delay`` (50 ms) later, in one ``EVALSHA`` per batch of the lookups of that window.
PEXPIRE never creates a key, so a late renewal cannot resurrect an entry deleted meanwhile.

Every other operation touches a single key or is a non-transactional pipeline. ``MGET`` and the
renewal script are multi-key, which Redis Cluster allows only within one slot, and entry keys
deliberately spread over slots: a cluster variant swaps the client (``_make_client``,
``_scan``) and points ``_read_entries`` / ``_write_side_effects`` at their pipelined
equivalents (``_read_entries_pipelined``, ``_write_side_effects_pipelined``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
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
from .base import DEFAULT_TTL_SECONDS, EntryRecord, Index, IndexEntry

log = logging.getLogger("kvcloud.index")

T = TypeVar("T")

DEFAULT_PREFIX = "kvc"
_SCAN_COUNT = 1000

# Compare-and-delete in one atomic step: deletes the entry only if it still names the object
# the caller verified, so a concurrent re-registration to a new object is never lost.
_DROP_IF_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, entry = pcall(cmsgpack.unpack, raw)
if not ok or type(entry) ~= 'table' or entry[1] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# The side effects of lookups, sent by the background thread in one command: KEYS[1] is the
# counters hash, KEYS[2..] the entries that were hit; ARGV[1] the TTL in ms, ARGV[2..] pairs of
# counter name and increment. PEXPIRE on a key deleted since the lookup (drop, gc) is a no-op,
# so a late renewal can never resurrect an entry.
_SIDE_EFFECTS_SCRIPT = """
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return #KEYS - 1
"""

# Keys renewed per script call: bounds how long one call keeps the (single-threaded) server busy.
_RENEW_BATCH = 512
# Pending renewals (counted with repeats: lookups only append, the thread deduplicates) past
# which the background thread sends at once instead of waiting out its delay.
_SEND_AT_KEYS = 16_384
# Past this many (Redis slow or down for a while) new renewals are dropped: a missed renewal
# only means an entry may expire earlier than it would have. ~100 bytes a key.
_MAX_PENDING_KEYS = 65_536
# Decoded entries kept by their packed bytes. Entries are immutable values, the same prefixes
# are looked up again and again (system prompts, continued sessions), and building the frozen
# IndexEntry costs ~10x the msgpack decode: with the cache a 128-entry decode drops from
# ~0.2 ms to ~0.02 ms. ~0.5 KB an entry.
_DECODE_CACHE_SIZE = 4096
# Seconds without work after which the background thread exits (a new one starts on demand).
_IDLE_EXIT = 30.0
# How often the background thread may log a failure (seconds), so an outage logs a line now
# and then instead of one per lookup.
_WARN_INTERVAL = 30.0


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


@functools.lru_cache(maxsize=_DECODE_CACHE_SIZE)
def _unpack_cached(raw: bytes) -> IndexEntry:
    # lru_cache never caches an exception, so undecodable values are reported every time.
    return IndexEntry.unpack(raw)


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class _Deferred:
    """Sends the side effects of lookups (TTL renewals of hits, counter increments) off the
    request path, from one daemon thread.

    ``submit`` appends to a list under a lock that is never held across I/O: the caller never
    waits for the network and never sees an exception. The thread wakes when the first item
    arrives, lets ``delay`` seconds of lookups accumulate, then sends them all as one batch
    (duplicate keys once). The delay is what keeps this cheap: a busy worker sends one batch
    per ``delay`` instead of one per lookup, so the thread rarely competes with the request
    path for the GIL and the server. A batch of _SEND_AT_KEYS goes out without waiting.
    ``flush`` cuts the delay short and waits until everything submitted before it was
    attempted; ``close`` flushes and stops the thread. The thread also exits after
    _IDLE_EXIT seconds without work; ``submit`` starts a new one when needed.

    When ``send`` fails with IndexUnavailableError (Redis unreachable or slow) the counters are
    kept for the next batch, since they would otherwise be lost, and renewals are dropped:
    they are only hints. Any other failure drops the batch. Either way it is logged, at most
    once per _WARN_INTERVAL. Renewals past ``max_keys`` pending are dropped (and logged).

    ``send`` is held weakly, so the thread does not keep an index that nobody closed alive.
    """

    def __init__(
        self,
        send: Callable[[list[str], dict[str, int]], None],
        name: str,
        *,
        delay: float = 0.05,
        max_keys: int = _MAX_PENDING_KEYS,
        retry_delay: float = 1.0,
    ) -> None:
        self._send_ref = weakref.WeakMethod(send)
        self._name = name
        self.delay = float(delay)
        self._max_keys = max_keys
        self._retry_delay = retry_delay
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._keys: list[Sequence[str]] = []  # one sequence per lookup, deduplicated later
        self._n_keys = 0
        self._counters: dict[str, int] = {}
        self._first_at = 0.0  # monotonic time of the oldest pending submission
        self._submitted = 0  # submissions accepted so far (a retry counts as a new one)
        self._attempted = 0  # submissions whose batch has been sent (or has failed)
        self._urgent = False  # a flush is waiting: skip the delay
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_warning = 0.0  # monotonic

    def _check_fork(self) -> None:
        # A forked child inherits the pending items (its parent sends them) and a lock some
        # parent thread may hold, but not the thread: start over empty.
        if os.getpid() != self._pid:
            self._reset()

    def _pending(self) -> bool:
        return bool(self._keys or self._counters)

    def _add_counters(self, counters: Mapping[str, int]) -> None:
        for name, n in counters.items():
            self._counters[name] = self._counters.get(name, 0) + int(n)

    def submit(self, keys: Sequence[str], counters: Mapping[str, int] | None) -> None:
        dropped = 0
        try:
            self._check_fork()
            with self._cond:
                was_idle = not self._pending()
                if keys:
                    if self._n_keys + len(keys) <= self._max_keys:
                        self._keys.append(keys)
                        self._n_keys += len(keys)
                        if self._n_keys >= _SEND_AT_KEYS > self._n_keys - len(keys):
                            self._cond.notify_all()  # a full batch: no need to wait
                    else:
                        dropped = len(keys)
                if counters:
                    self._add_counters(counters)
                if dropped < len(keys) or counters:
                    self._submitted += 1
                    if was_idle:
                        # Wake the thread only for the first item of a batch; the rest
                        # just join the list while it waits out the delay.
                        self._first_at = time.monotonic()
                        self._cond.notify_all()
                    self._ensure_thread()
        except Exception as exc:  # the request path must not fail for a side effect
            self._warn(f"lookup side effects dropped: {type(exc).__name__}: {exc}")
        if dropped:
            self._warn(f"{dropped} TTL renewals dropped: too many pending (Redis slow?)")

    def _ensure_thread(self) -> None:
        # Called with the lock held. The thread clears self._thread itself, under the lock,
        # when it exits, so an item added after that starts a new thread.
        if self._thread is None:
            self._stopping = False
            thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            thread.start()
            self._thread = thread

    def flush(self, timeout: float) -> bool:
        """Send what is pending now and wait until it was attempted; False on timeout."""
        self._check_fork()
        with self._cond:
            target = self._submitted
            if self._attempted >= target:
                return True
            self._urgent = True
            self._ensure_thread()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._attempted >= target, timeout)

    def stop(self) -> None:
        """Let the thread exit once nothing is pending, without waiting for it.

        Runs from a GC finalizer, possibly on the thread itself while it holds the lock, so
        it never blocks on the lock: without it the flag is still seen at the next wake-up.
        """
        self._stopping = True
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            log.warning(
                "%s: pending TTL renewals and counters not sent in %.1fs", self._name, timeout
            )
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                self._cond.notify_all()

    def _run_once(self) -> bool:
        """Wait for a batch and send it; False when the thread should exit."""
        with self._cond:
            while not self._pending():
                idle = self._stopping or not self._cond.wait(_IDLE_EXIT)
                if idle and not self._pending():
                    self._thread = None  # under the lock: a later submit starts a new one
                    return False
            # Let the batch fill for `delay` after its first item (bounded: a renewal lands
            # within delay + one round trip of its lookup).
            while not (self._urgent or self._stopping or self._n_keys >= _SEND_AT_KEYS):
                left = self._first_at + self.delay - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            lists, self._keys, self._n_keys = self._keys, [], 0
            counters, self._counters = self._counters, {}
            upto, self._urgent = self._submitted, False
        # Deduplicated, in first-seen order, outside the lock.
        keys = list(dict.fromkeys(key for part in lists for key in part))
        retry = False
        send = self._send_ref()
        try:
            if send is None:
                return False  # the index is gone without close(): nothing to send with
            send(keys, counters)
        except IndexUnavailableError as exc:
            retry = bool(counters)
            self._warn(f"{len(keys)} TTL renewals not sent: {exc}")
        except Exception as exc:  # a daemon thread has no caller to raise to
            self._warn(f"{len(keys)} TTL renewals and counters {counters} not sent: {exc}")
        finally:
            del send
        with self._cond:
            if retry and not self._stopping:
                if not self._pending():
                    self._first_at = time.monotonic() + self._retry_delay  # do not spin
                self._add_counters(counters)
                self._submitted += 1  # so that a later flush waits for the retry
            elif retry:
                log.warning("%s: counters lost on close: %s", self._name, counters)
            self._attempted = max(self._attempted, upto)
            self._cond.notify_all()
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + _WARN_INTERVAL
            log.warning("%s: %s", self._name, message)
        else:
            log.debug("%s: %s", self._name, message)


class RedisIndex(Index):
    """Index in Redis (``redis://`` or TLS ``rediss://``).

    URL: ``redis://[user:password@]host:port/db?prefix=kvc&ttl=604800``. ``prefix`` and
    ``ttl`` (seconds; overrides ``ttl_seconds`` when present) are kvcloud's own options;
    any other query option is passed to redis-py (e.g. ``ssl_ca_certs`` for rediss://).

    ``lookup`` is one MGET; the sliding-TTL renewal of its hits and its ``counters`` are sent
    by a background thread ``renew_delay`` seconds later (batched with the lookups of that
    window), so they may lag a lookup by that much plus a round trip. ``counters()`` and
    ``close()`` send whatever is pending first, so a process reads its own increments and a
    clean close loses none.
    """

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
        super().__init__(ttl_seconds)
        if self.ttl_seconds <= 0:
            raise ConfigError(f"index URL {self.url!r}: ttl must be positive")
        if not prefix or "{" in prefix or "}" in prefix:
            # Braces would form a Redis Cluster hash tag and pin every key to one slot.
            raise ConfigError(f"index URL {self.url!r}: prefix must be non-empty, without braces")
        self.prefix = prefix
        self._ttl_ms = self.ttl_seconds * 1000
        self._counters_key = f"{prefix}:counters"

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
        self._drop_if = self._client.register_script(_DROP_IF_SCRIPT)
        self._side_effects = self._client.register_script(_SIDE_EFFECTS_SCRIPT)
        self._deferred = _Deferred(
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

    def _read_entries(self, keys: list[str]) -> list[bytes | None]:
        """The request path of ``lookup``: the raw values of ``keys``, in one round trip.

        One MGET: a single command to pack and a single reply to parse, several times cheaper
        than a pipeline of as many GETs. It does not renew TTLs (see _write_side_effects).
        Multi-key, so one slot only: a cluster variant uses _read_entries_pipelined.
        """
        return self._client.execute_command("MGET", *keys)

    def _read_entries_pipelined(self, keys: list[str]) -> list[bytes | None]:
        """_read_entries for servers where MGET cannot span the keys (Redis Cluster): a
        non-transactional pipeline of GETs (one round trip per node involved)."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def _write_side_effects(self, keys: list[str], counters: dict[str, int]) -> None:
        """Background thread: slide the TTL of ``keys`` (lookup hits) and add ``counters``.

        One EVALSHA per _RENEW_BATCH keys, the counters riding on the last one (so a failure
        of an earlier call leaves them unsent, for the retry). Multi-key: a cluster variant
        uses _write_side_effects_pipelined.
        """
        tail = [item for name, n in counters.items() for item in (name, int(n))]
        batches = [keys[i : i + _RENEW_BATCH] for i in range(0, len(keys), _RENEW_BATCH)] or [[]]
        with self._errors():
            for i, batch in enumerate(batches):
                last = i == len(batches) - 1
                args = [self._ttl_ms, *tail] if last else [self._ttl_ms]
                self._side_effects(keys=[self._counters_key, *batch], args=args)

    def _write_side_effects_pipelined(self, keys: list[str], counters: dict[str, int]) -> None:
        """_write_side_effects with single-key commands only (Redis Cluster)."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.pexpire(key, self._ttl_ms)
        for name, n in counters.items():
            pipe.hincrby(self._counters_key, name, int(n))
        with self._errors():
            pipe.execute()

    # -- keys and errors --------------------------------------------------------------------

    def _entry_key(self, ns: str, fp: str) -> str:
        return f"{self.prefix}:e:{_component(ns)}:{_component(fp)}"

    def _entry_keys(self, ns: str, fps: list[str]) -> list[str]:
        """_entry_key of every fp, fast when all are plain ASCII letters and digits (hex
        fingerprints always are): those need no escaping, and quote() per fp would cost
        ~1 µs each, a sizeable part of a 128-chunk lookup."""
        head = f"{self.prefix}:e:{_component(ns)}:"
        joined = "".join(fps)
        if joined.isascii() and (not joined or joined.encode().isalnum()):
            return [head + fp for fp in fps]
        return [head + _component(fp) for fp in fps]

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
        key = self._entry_key(ns, fp)
        with self._errors():
            return bool(self._client.set(key, entry.pack(), nx=True, px=self._ttl_ms))

    def register_many(self, ns: str, entries: Sequence[tuple[str, IndexEntry]]) -> list[bool]:
        entries = list(entries)
        if not entries:
            return []
        # One non-transactional pipeline = one round trip; each SET NX stands alone (no
        # MULTI), so it works key by key in a cluster too.
        pipe = self._client.pipeline(transaction=False)
        for key, (_, entry) in zip(
            self._entry_keys(ns, [fp for fp, _ in entries]), entries, strict=True
        ):
            pipe.set(key, entry.pack(), nx=True, px=self._ttl_ms)
        with self._errors():
            replies = pipe.execute()
        return [bool(r) for r in replies]

    def lookup(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry | None]:
        fps = list(fps)
        if not fps:
            if counters:
                self._deferred.submit((), counters)
            return []
        keys = self._entry_keys(ns, fps)
        # The request path is this one round trip. The TTL renewal of the hits and the
        # counters go to the background thread, and only once the read succeeded: when it
        # raises, the caller still owns its counters (KVCloud puts them back for later).
        with self._errors():
            raws = self._read_entries(keys)
        if len(raws) != len(keys):
            raise IndexBackendError(
                f"redis index {self.url}: {len(raws)} values for {len(keys)} keys"
            )
        try:  # the hot path: comprehensions over a cached decode
            found = [None if raw is None else _unpack_cached(raw) for raw in raws]
        except Exception:  # some garbage value: decode one by one, logging it as a miss
            found = [self._decode(ns, fp, raw) for fp, raw in zip(fps, raws, strict=True)]
        # Only the hits are renewed: a miss has nothing to renew, and an undecodable value is
        # left to expire.
        hits = [key for key, entry in zip(keys, found, strict=True) if entry is not None]
        if hits or counters:
            self._deferred.submit(hits, counters)
        return found

    def _decode(self, ns: str, fp: str, raw: bytes | None) -> IndexEntry | None:
        # Uncached: iter_entries streams every entry once, which would only flush the cache.
        if raw is None:
            return None
        try:
            return IndexEntry.unpack(raw)
        except Exception as exc:  # any garbage value: the index is only a hint
            log.warning("redis index: undecodable entry %s:%s treated as a miss: %s", ns, fp, exc)
            return None

    def drop(self, ns: str, fp: str, object_key: str | None = None) -> bool:
        key = self._entry_key(ns, fp)
        with self._errors():
            if object_key is None:
                return bool(self._client.delete(key))
            return bool(self._drop_if(keys=[key], args=[object_key]))

    def iter_entries(self, ns: str | None = None) -> Iterator[EntryRecord]:
        scope = "*" if ns is None else _glob_escape(_component(ns)) + ":*"
        pattern = f"{_glob_escape(self.prefix)}:e:{scope}"
        with self._errors():
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
                    entry = self._decode(parts[0], parts[1], raw)
                    if entry is None:
                        continue
                    expires_at = now + pttl / 1000 if pttl is not None and pttl >= 0 else None
                    yield EntryRecord(ns=parts[0], fp=parts[1], entry=entry, expires_at=expires_at)

    def count_entries(self, ns: str | None = None) -> int:
        scope = "*" if ns is None else _glob_escape(_component(ns)) + ":*"
        pattern = f"{_glob_escape(self.prefix)}:e:{scope}"
        with self._errors():
            # SCAN may repeat a key while the table rehashes; count each once.
            return len(set(self._scan(pattern)))

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
