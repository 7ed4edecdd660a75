"""Prove that a store and an index answer real requests, in bounded time, and say what to fix.

Backends open lazily: building an S3 client or a Redis connection pool sends nothing, so a
store URL with a closed port, a missing bucket or refused credentials only fails at the
first real request. A server that must share KV (a vLLM connector at start, ``kvcloud
doctor``) calls :func:`probe` instead: a small object written, read back and deleted under
``_probe/``, and a session record written, read back and deleted under scope ``_probe``,
all within a time limit even when a server accepts connections and never answers. Each
failure is one :class:`~kvcloud.errors.ProbeError` line naming the redacted URL, what
failed and the fix.

:func:`key_id` (defined with the keys in :mod:`kvcloud.namespace`) names a fingerprint key
in public: the first 12 hex digits of HMAC-SHA256(tenant key, "kvcloud-key-id-v1"), so two
servers can check that they would share KV (same id) without showing their secret.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import unquote

import numpy as np

from .config import KVCloudConfig
from .errors import ConfigError, ProbeError
from .indexes import sqlite_path
from .indexes.base import Index
from .indexes.sqlite import require_database
from .namespace import key_id  # re-exported: doctor and the connector name keys by it
from .sessions import SessionRecord, pack_record
from .stores.base import ObjectStore
from .stores.file import require_store_root
from .urls import redact_url, split_url

#: where the store probe writes its object (deleted right after; a crash leaves one small
#: object that no entry names and that gc never touches, its key not being a kvcloud key)
PROBE_PREFIX = "_probe"
#: the session scope of the index probe's record (a valid, empty session record: verify
#: counts one seen mid-probe as a healthy session)
PROBE_SCOPE = "_probe"
#: lifetime of the index probe's record, should the delete never run
PROBE_TTL_SECONDS = 60
PROBE_BYTES = 4096


@dataclass
class ProbeReport:
    """What :func:`probe` measured: the (redacted) URLs, each step's seconds, the key id."""

    store: str
    index: str
    key_id: str
    store_seconds: dict[str, float] = field(default_factory=dict)  # put, get, delete
    index_seconds: float = 0.0  # the whole round trip
    seconds: float = 0.0  # the probe from start to end, opening included

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- must exist --------------------------------------------------------------------------------


def require_store(url: str) -> None:
    """For readers (stats, ls, verify, gc, doctor): a ``file://`` store must already exist,
    so a mistyped path fails with ConfigError ("no store at …") instead of being created
    empty. Other schemes create nothing on open; their requests say what is missing."""
    scheme, netloc, path, _ = split_url(url)
    if scheme == "file" and unquote(netloc + path):
        require_store_root(unquote(netloc + path))


def require_index(url: str) -> None:
    """For readers: a ``sqlite://`` index must already exist and be a kvcloud index, so a
    mistyped path fails with ConfigError ("no index at …") instead of being created empty."""
    scheme, netloc, path, _ = split_url(url)
    if scheme == "sqlite":
        require_database(sqlite_path(netloc, path))


# --- what went wrong, in one line -------------------------------------------------------------


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _find(exc: BaseException, *names: str, exact: bool = False) -> BaseException | None:
    """The first exception in the chain whose class (or, unless ``exact``, a base class) has
    one of the names: by name, so this module needs neither botocore nor redis-py."""
    for e in _chain(exc):
        classes = (type(e),) if exact else type(e).__mro__
        if any(c.__name__ in names for c in classes):
            return e
    return None


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def store_failure(exc: BaseException, url: str, step: str) -> ProbeError:
    """The one-line explanation of a store probe's failure at ``step``."""
    where = redact_url(url)
    if isinstance(exc, ProbeError):
        return exc
    client = _find(exc, "ClientError")
    if client is not None:
        response: dict[str, Any] = getattr(client, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", "?"))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code == "NoSuchBucket" or (status == 404 and step == "bucket"):
            return ProbeError(
                "store",
                where,
                "the bucket does not exist",
                "create it (aws s3 mb, mc mb) or add create_bucket=true to the store URL",
            )
        if status == 403 or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return ProbeError(
                "store",
                where,
                f"the server refused the credentials at {step} ({code}, HTTP {status})",
                "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and that they may put, "
                "get and delete objects under the store's prefix",
            )
        if status >= 500:
            return ProbeError(
                "store",
                where,
                f"the server failed {step} ({code}, HTTP {status})",
                "the S3 server is failing or overloaded: check its logs and health",
            )
        return ProbeError(
            "store", where, f"{step} failed ({code}, HTTP {status})", "check the store URL"
        )
    if _find(exc, "NoCredentialsError", "PartialCredentialsError") is not None:
        return ProbeError(
            "store",
            where,
            "no AWS credentials",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an instance role)",
        )
    # urllib3's NewConnectionError (a refused connection) derives from its
    # ConnectTimeoutError: look for the refusal first, and for timeouts by exact name
    refused = _find(
        exc, "EndpointConnectionError", "NewConnectionError", "ConnectionRefusedError", exact=True
    )
    timeout = _find(exc, "ReadTimeoutError", "ConnectTimeoutError", "TimeoutError", exact=True)
    if timeout is not None and refused is None:
        return ProbeError(
            "store",
            where,
            f"{step} timed out ({_short(timeout)})",
            "check that endpoint_url is an S3 server and not overloaded, or raise "
            "KVCLOUD_CONNECT_TIMEOUT/KVCLOUD_READ_TIMEOUT",
        )
    unreachable = _find(exc, "EndpointConnectionError", "ConnectionError", "HTTPClientError")
    if unreachable is not None:
        return ProbeError(
            "store",
            where,
            f"cannot connect ({_short(unreachable)})",
            "check that the S3 server runs at endpoint_url (host, port, http vs https, "
            "firewall, proxy)",
        )
    os_error = _find(exc, "OSError")
    if isinstance(os_error, OSError) and os_error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ProbeError(
            "store",
            where,
            f"cannot {step} ({os_error.strerror})",
            "make the directory writable by this user, or point KVCLOUD_STORE at one that is",
        )
    if isinstance(exc, ConfigError):
        return ProbeError("store", where, _short(exc), "fix KVCLOUD_STORE (or --store)")
    return ProbeError(
        "store", where, f"{step} failed ({_short(exc)})", "check the store and its URL"
    )


def index_failure(exc: BaseException, url: str, step: str) -> ProbeError:
    """The one-line explanation of an index probe's failure at ``step``."""
    where = redact_url(url)
    if isinstance(exc, ProbeError):
        return exc
    if _find(exc, "AuthenticationError", "AuthenticationWrongNumberOfArgsError") is not None:
        return ProbeError(
            "index",
            where,
            "the server refused the password (or wants one)",
            "check the user name and password in the index URL (KVCLOUD_INDEX)",
        )
    denied = _find(exc, "NoPermissionError", "AuthorizationError")
    if denied is not None:
        return ProbeError(
            "index",
            where,
            f"the Redis user may not {step} ({_short(denied)})",
            "grant the user read and write on kvcloud's keys (ACL: ~<prefix>:* +@all)",
        )
    if _find(exc, "ReadOnlyError") is not None:
        return ProbeError(
            "index",
            where,
            "the server is a read-only replica",
            "point KVCLOUD_INDEX at the primary (or the cluster, redis+cluster://)",
        )
    timeout = _find(exc, "TimeoutError")
    if timeout is not None and _find(exc, "RedisError") is not None:
        return ProbeError(
            "index",
            where,
            f"{step} timed out ({_short(timeout)})",
            "check that the host and port are a Redis server and not overloaded, or raise "
            "KVCLOUD_CONNECT_TIMEOUT/KVCLOUD_READ_TIMEOUT",
        )
    unreachable = _find(exc, "ConnectionError")
    if unreachable is not None and _find(exc, "RedisError") is not None:
        return ProbeError(
            "index",
            where,
            f"cannot connect ({_short(unreachable)})",
            "check that redis-server runs at that host and port (firewall, TLS: rediss:// "
            "vs redis://)",
        )
    os_error = _find(exc, "OSError")
    sqlite_ro = "readonly" in str(exc).lower() or "read-only" in str(exc).lower()
    if sqlite_ro or (
        isinstance(os_error, OSError) and os_error.errno in (errno.EACCES, errno.EPERM)
    ):
        return ProbeError(
            "index",
            where,
            f"cannot {step} ({_short(exc)})",
            "make the database and its directory writable by this user",
        )
    if isinstance(exc, ConfigError):
        return ProbeError("index", where, _short(exc), "fix KVCLOUD_INDEX (or --index)")
    return ProbeError(
        "index", where, f"{step} failed ({_short(exc)})", "check the index and its URL"
    )


# --- the probes --------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def probe_store(
    store: ObjectStore, *, key: str | None = None, on_step: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Write a small random object under ``_probe/``, read it back and compare, delete it.

    Returns each step's seconds (``put``, ``get``, ``delete``); raises ProbeError naming the
    step that failed. ``key`` picks the object's key (default: a random one under
    ``_probe/``); ``on_step`` is told each step before it starts."""
    key = key or f"{PROBE_PREFIX}/{secrets.token_hex(8)}"
    payload = secrets.token_bytes(PROBE_BYTES)
    timings: dict[str, float] = {}
    step = "put"
    try:
        for step, fn in (
            ("put", lambda: store.put(key, payload)),
            ("get", lambda: store.get(key)),
        ):
            if on_step:
                on_step(step)
            result, timings[step] = _timed(fn)
        if bytes(result) != payload:
            raise ProbeError(
                "store",
                redact_url(store.url),
                f"read back different bytes than were written ({key})",
                "the store or a proxy in front of it corrupts data: check it before use",
            )
        step = "delete"
        if on_step:
            on_step(step)
        _, timings["delete"] = _timed(lambda: store.delete(key))
    except BaseException as exc:
        if step != "put":  # best effort: do not leave the probe behind
            with contextlib.suppress(Exception):
                store.delete(key)
        if isinstance(exc, Exception) and not isinstance(exc, ProbeError):
            raise store_failure(exc, store.url, step) from exc
        raise
    return timings


def probe_record() -> bytes:
    """The index probe's record: a valid session record that names no object."""
    return pack_record(
        SessionRecord(
            session_id="probe",
            ns=PROBE_SCOPE,
            tokens=np.zeros(0, dtype="<u4"),
            kv_tokens=0,
            chunk_keys=(),
            tail_key=None,
            updated=time.time(),
            meta={"probe": secrets.token_hex(8)},
        )
    )


def probe_index(index: Index, *, on_step: Callable[[str], None] | None = None) -> float:
    """Write a probe session record (scope ``_probe``, a 60 s TTL), read it back and compare,
    delete it. Returns the round trip's seconds; raises ProbeError naming the failed step."""
    session_id = secrets.token_hex(8)
    record = probe_record()
    step = "write"
    start = time.perf_counter()
    try:
        if on_step:
            on_step("write")
        index.put_session(PROBE_SCOPE, session_id, record, ttl_seconds=PROBE_TTL_SECONDS)
        step = "read"
        if on_step:
            on_step("read")
        got = index.get_session(PROBE_SCOPE, session_id)
        if got != record:
            raise ProbeError(
                "index",
                redact_url(index.url),
                "a record written was not read back"
                if got is None
                else "read back a different record than was written",
                "check that every client reaches the same server and database (a replica "
                "or proxy that loses writes?)",
            )
        step = "delete"
        if on_step:
            on_step("delete")
        index.delete_session(PROBE_SCOPE, session_id)
    except BaseException as exc:
        if step != "write":
            with contextlib.suppress(Exception):
                index.delete_session(PROBE_SCOPE, session_id)
        if isinstance(exc, Exception) and not isinstance(exc, ProbeError):
            raise index_failure(exc, index.url, step) from exc
        raise
    return time.perf_counter() - start


def probe(config: KVCloudConfig, timeout: float) -> ProbeReport:
    """Open the store and the index ``config`` names and probe both (:func:`probe_store`,
    :func:`probe_index`), in at most ``timeout`` seconds in all.

    The work runs in a daemon thread; a server that accepts connections and never answers
    costs ``timeout``, after which ProbeError says which one did not answer (the thread
    finishes or dies with the process). Opening creates what the backends create for a
    writer (a ``file://`` directory, a ``sqlite://`` file), as the server that calls this
    would at its first write."""
    if timeout <= 0:
        raise ConfigError(f"probe timeout must be positive, got {timeout!r}")
    report = ProbeReport(
        store=redact_url(config.store),
        index=redact_url(config.index),
        key_id=key_id(config.secret, config.tenant),
    )
    where = {"target": "store", "step": "open"}
    outcome: dict[str, BaseException] = {}

    def at(target: str, step: str) -> None:
        where["target"], where["step"] = target, step

    def run() -> None:
        store: ObjectStore | None = None
        index: Index | None = None
        try:
            at("store", "open")
            store = config.open_store()
            report.store_seconds = probe_store(store, on_step=lambda s: at("store", s))
            at("index", "open")
            index = config.open_index()
            report.index_seconds = probe_index(index, on_step=lambda s: at("index", s))
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            for backend in (index, store):
                if backend is not None:
                    with contextlib.suppress(Exception):
                        backend.close()

    start = time.monotonic()
    worker = threading.Thread(target=run, name="kvcloud-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    report.seconds = time.monotonic() - start
    if worker.is_alive():
        target = where["target"]
        url = report.store if target == "store" else report.index
        server = "an S3 server" if url.startswith("s3://") else "the server it names"
        if url.startswith(("redis", "rediss")):
            server = "a Redis server"
        raise ProbeError(
            target,
            url,
            f"did not answer within {timeout:g} s ({target} {where['step']})",
            f"check that it is {server}, reachable and not overloaded (a port that accepts "
            "connections and never answers looks like this)",
        )
    error = outcome.get("error")
    if error is None:
        return report
    if isinstance(error, ProbeError) or not isinstance(error, Exception):
        raise error
    if where["target"] == "store":
        raise store_failure(error, config.store, where["step"]) from error
    raise index_failure(error, config.index, where["step"]) from error


__all__ = [
    "PROBE_PREFIX",
    "PROBE_SCOPE",
    "ProbeReport",
    "index_failure",
    "key_id",
    "probe",
    "probe_index",
    "probe_store",
    "require_index",
    "require_store",
    "store_failure",
]
