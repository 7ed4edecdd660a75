"""Redis index: the shared index for many workers on many machines.

Key schema (``prefix`` defaults to ``kvc``)::

    {prefix}:e:{ns}:{fp}                 entry, value = IndexEntry.pack(), sliding TTL
    {prefix}:s:{scope}:{session_id}      session record, optional TTL
    {prefix}:counters                    hash of named counters

Every key component is percent-encoded (:func:`_component`), so a ``:`` or glob character in
a tenant-controlled string cannot reach another tenant's key or widen a SCAN pattern. Entry
keys carry no hash tag on purpose: in Redis Cluster they must spread over slots by
fingerprint rather than pin a whole namespace to one node.

Every operation touches a single key or is a non-transactional pipeline, so a cluster variant
only has to swap the client (see ``_make_client`` and ``_scan``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis import exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ..config import redact_url
from ..errors import ConfigError, IndexBackendError, IndexUnavailableError
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

    URL: ``redis://[user:password@]host:port/db?prefix=kvc&ttl=604800``. ``prefix`` and
    ``ttl`` (seconds; overrides ``ttl_seconds`` when present) are kvcloud's own options;
    any other query option is passed to redis-py (e.g. ``ssl_ca_certs`` for rediss://).
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

    # -- hooks a cluster variant overrides --------------------------------------------------

    def _make_client(self, url: str, **kwargs: Any) -> Any:
        return redis.Redis.from_url(url, **kwargs)

    def _scan(self, pattern: str) -> Iterator[bytes]:
        return self._client.scan_iter(match=pattern, count=_SCAN_COUNT)

    # -- keys and errors --------------------------------------------------------------------

    def _entry_key(self, ns: str, fp: str) -> str:
        return f"{self.prefix}:e:{_component(ns)}:{_component(fp)}"

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

    def lookup(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry | None]:
        fps = list(fps)
        if not fps and not counters:
            return []
        # One pipeline = one network round trip, however many fingerprints: GETEX reads and
        # slides the TTL of hits at once; the counter increments ride along for free.
        pipe = self._client.pipeline(transaction=False)
        for fp in fps:
            pipe.getex(self._entry_key(ns, fp), px=self._ttl_ms)
        for name, n in (counters or {}).items():
            pipe.hincrby(self._counters_key, name, int(n))
        with self._errors():
            replies = pipe.execute()
        # strict=False: the counter replies follow the entries and are not needed
        return [self._decode(ns, fp, raw) for fp, raw in zip(fps, replies, strict=False)]

    def _decode(self, ns: str, fp: str, raw: bytes | None) -> IndexEntry | None:
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
        with self._errors():
            raw = self._client.hgetall(self._counters_key)
        return {_text(k): int(v) for k, v in raw.items()}

    def ping(self) -> float:
        start = time.perf_counter()
        with self._errors():
            self._client.ping()
        return max(time.perf_counter() - start, 1e-9)

    def close(self) -> None:
        try:
            self._client.close()
        except rexc.RedisError as exc:
            log.debug("redis index %s: close: %s", self.url, exc)


__all__ = ["DEFAULT_PREFIX", "RedisIndex", "default_retry"]
