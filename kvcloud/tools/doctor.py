"""``kvcloud doctor``: check the configured store and index end to end and say what to fix.

Each check yields one :class:`Check` (ok / warn / FAIL / info, a detail, and the fix when it
is not ok). A line says ok only after a real request to the server succeeded: backends open
lazily, so opening one proves nothing. Nothing here raises for a broken deployment: an
unreachable endpoint or wrong credentials become a FAIL line naming the redacted URL,
because the whole point of the command is to explain failures rather than print tracebacks.
The probes themselves (a write, read and delete of an object and of an index record) are
:mod:`kvcloud.probe`'s, the ones a vLLM connector runs at start.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from ..config import KVCloudConfig
from ..errors import KVCloudError, ProbeError, StoreUnavailableError
from ..indexes import open_index
from ..probe import (
    PROBE_BYTES,
    PROBE_PREFIX,
    PROBE_SCOPE,
    key_id,
    probe_index,
    probe_store,
    require_index,
    require_store,
)
from ..stores import open_store, s3_writes
from ..stores.base import ObjectStore
from ..urls import redact_url

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"

# Skew beyond this makes S3 reject signed requests (SigV4 allows 15 min) long before, and
# already distorts TTL and gc grace arithmetic that compares worker and server clocks.
SKEW_WARN_SECONDS = 5.0
SKEW_FAIL_SECONDS = 300.0
# A probe round trip slower than this will eat most of a worker's --remote-timeout (2 s).
SLOW_SECONDS = 0.5

# Policies that may evict keys without a TTL: kvcloud's session records (and the counters
# hash) have none, so losing them silently breaks session resume.
_EVICTS_PERSISTENT = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


@dataclass
class Check:
    target: str  # "store", "index", "client" or "vllm"
    name: str
    status: str  # OK, WARN, FAIL or INFO (a setting, not a verdict)
    detail: str
    fix: str = ""
    seconds: float | None = None

    def line(self) -> str:
        text = f"{self.status:4} {self.target} {self.name}: {self.detail}"
        return f"{text} — fix: {self.fix}" if self.fix else text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _describe(exc: BaseException) -> str:
    # kvcloud's own errors already name the redacted URL and what to check; anything else
    # gets its type so the one line still says what kind of failure it was.
    if isinstance(exc, KVCloudError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _skew_check(target: str, server_time: float, sent: float, received: float) -> Check:
    # Compare with the midpoint of the request: half the round trip is the best guess of
    # when the server read its clock.
    skew = server_time - (sent + received) / 2
    detail = f"server clock {skew:+.2f} s vs this machine (round trip {_ms(received - sent)})"
    if abs(skew) >= SKEW_FAIL_SECONDS:
        return Check(target, "clock skew", FAIL, detail, "sync clocks with NTP (chrony/timesyncd)")
    if abs(skew) >= SKEW_WARN_SECONDS:
        return Check(target, "clock skew", WARN, detail, "sync clocks with NTP (chrony/timesyncd)")
    return Check(target, "clock skew", OK, detail)


# --- store -------------------------------------------------------------------------------------


def check_store(url: str, cfg: KVCloudConfig) -> Iterator[Check]:
    where = redact_url(url)
    try:
        require_store(url)  # a reader never creates the store it checks
    except KVCloudError as exc:
        fix = (
            "check KVCLOUD_STORE (or --store) for a typo; a new store's directory is created "
            "by the first worker or vLLM that writes to it"
        )
        yield Check("store", "open", FAIL, str(exc), fix)
        return
    try:
        store = open_store(
            url, max_workers=2, connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout
        )
    except Exception as exc:
        yield Check("store", "open", FAIL, f"{where}: {_describe(exc)}", "fix the store URL")
        return
    try:
        if type(store).__name__ == "S3Store":
            bucket_checks = list(_check_s3_bucket(store))
            yield from bucket_checks
            if any(c.status == FAIL for c in bucket_checks):
                return  # a probe against a missing bucket would only repeat the failure
        probe_checks = list(_probe(store))
        yield from probe_checks
        if type(store).__name__ == "S3Store" and all(c.status != FAIL for c in probe_checks):
            yield from _check_conditional_writes(store)
    finally:
        store.close()


def _check_conditional_writes(store: Any) -> Iterator[Check]:
    """Whether the server honours If-None-Match on PUT (the probe runs on the first write,
    which ``_probe`` just did). Both answers are correct; the other one costs a HEAD."""
    try:
        found = store.conditional_writes()
    except Exception as exc:
        yield Check("store", "conditional writes", WARN, _describe(exc))
        return
    if found == s3_writes.HONOURED:
        detail = "the server answers 412 to If-None-Match: * (one PUT per new object)"
    elif found == s3_writes.OFF:
        detail = "conditional_put=off: a HEAD before each PUT"
    else:
        detail = (
            f"the server {'ignores' if found == s3_writes.IGNORED else 'refuses'} "
            "If-None-Match: * "
            "on PUT; kvcloud asks with a HEAD before each PUT instead (same guarantees, "
            "one extra round trip per object written)"
        )
    yield Check("store", "conditional writes", OK, detail)


def _check_s3_bucket(store: Any) -> Iterator[Check]:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket = store.config.bucket
    sent = time.time()
    try:
        response = store._client.head_bucket(Bucket=bucket)
    except (ClientError, BotoCoreError) as exc:
        code, status = store._status(exc)
        if status == 404 or code in ("NoSuchBucket", "404"):
            yield Check(
                "store",
                "bucket",
                FAIL,
                f"bucket {bucket!r} does not exist at {store.url}",
                "create it (aws s3 mb / mc mb), or add ?create_bucket=true to the store URL",
            )
        else:
            error = store._error("head_bucket", bucket, exc)
            fix = (
                "check that the S3 endpoint is up and reachable from here (endpoint_url, "
                "DNS, firewall, http vs https)"
                if isinstance(error, StoreUnavailableError)
                else "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy"
            )
            yield Check("store", "bucket", FAIL, str(error), fix)
        return
    received = time.time()
    yield Check("store", "bucket", OK, f"bucket {bucket!r} exists", seconds=received - sent)
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        yield Check("store", "clock skew", WARN, "the S3 server sent no Date header")
        return
    try:
        server_time = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        yield Check("store", "clock skew", WARN, f"unparseable Date header {date!r}")
        return
    # The Date header has whole-second resolution: allow for that before warning.
    check = _skew_check("store", server_time + 0.5, sent, received)
    yield check


def _probe(store: ObjectStore) -> Iterator[Check]:
    key = f"{PROBE_PREFIX}/{secrets.token_hex(8)}"
    try:
        timings = probe_store(store, key=key)
    except ProbeError as exc:
        yield Check("store", "probe", FAIL, f"{key}: {exc.what}", exc.fix)
        return
    try:
        gone = store.head(key) is None
    except Exception as exc:
        yield Check("store", "probe", FAIL, f"{key}: head after delete: {_describe(exc)}")
        return
    if not gone:
        yield Check(
            "store",
            "probe",
            WARN,
            f"{key} still listed after delete",
            "the store is not read-after-delete consistent; gc may report stale orphans",
        )
    total = sum(timings.values())
    detail = (
        f"write/read/delete {PROBE_BYTES} B under {PROBE_PREFIX}/: "
        f"put {_ms(timings['put'])}, get {_ms(timings['get'])}, "
        f"delete {_ms(timings['delete'])}"
    )
    if max(timings.values()) > SLOW_SECONDS:
        yield Check(
            "store",
            "probe",
            WARN,
            detail,
            "the store is slow from here; workers will fall back to recompute more often "
            "(check network path, region, or raise --remote-timeout)",
            seconds=total,
        )
    else:
        yield Check("store", "probe", OK, detail, seconds=total)


# --- index -------------------------------------------------------------------------------------


def check_index(url: str, cfg: KVCloudConfig) -> Iterator[Check]:
    where = redact_url(url)
    try:
        require_index(url)  # a reader never creates the index it checks
    except KVCloudError as exc:
        fix = (
            "check KVCLOUD_INDEX (or --index) for a typo; a new index is created by the first "
            "worker or vLLM that writes to it"
        )
        yield Check("index", "open", FAIL, str(exc), fix)
        return
    if url.startswith("sqlite://"):
        sqlite_checks = list(_check_sqlite_path(url))
        yield from sqlite_checks
        if any(c.status == FAIL for c in sqlite_checks):
            return
    try:
        index = open_index(
            url,
            ttl_seconds=cfg.ttl_seconds,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
        )
    except Exception as exc:
        yield Check("index", "open", FAIL, f"{where}: {_describe(exc)}", "fix the index URL")
        return
    try:
        try:
            samples = [index.ping() for _ in range(5)]
        except Exception as exc:
            yield Check(
                "index",
                "reachable",
                FAIL,
                _describe(exc),
                "check that the server runs at that host/port and the credentials in the URL",
            )
            return
        rtt = sorted(samples)[len(samples) // 2]
        status = WARN if rtt > SLOW_SECONDS / 5 else OK
        fix = "the index is far away or overloaded; lookups add this to every request"
        yield Check(
            "index",
            "reachable",
            status,
            f"{index.url}: round trip {_ms(rtt)} (median of 5)",
            fix if status == WARN else "",
            seconds=rtt,
        )
        try:
            seconds = probe_index(index)
        except ProbeError as exc:
            yield Check("index", "round trip", FAIL, exc.what, exc.fix)
            return
        yield Check(
            "index",
            "round trip",
            OK,
            f"write/read/delete a record under scope {PROBE_SCOPE}: {_ms(seconds)}",
            seconds=seconds,
        )
        client = getattr(index, "_client", None)
        if client is not None and type(index).__name__ == "RedisIndex":
            yield from _check_redis(client)
            yield from _check_buckets(client, index)
    finally:
        index.close()


def _check_sqlite_path(url: str) -> Iterator[Check]:
    from ..indexes import sqlite_path
    from ..urls import split_url

    _scheme, netloc, path, _query = split_url(url)
    try:
        db = Path(sqlite_path(netloc, path))
    except KVCloudError as exc:
        yield Check("index", "sqlite path", FAIL, str(exc), "fix the index URL")
        return
    directory = db.parent if str(db.parent) else Path(".")
    # The database, its -wal and -shm files all live in the directory: it must be writable,
    # not just the file. (It exists: require_index checked the database.)
    probe = directory / f".kvcloud-doctor-{secrets.token_hex(4)}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        yield Check(
            "index",
            "sqlite path",
            FAIL,
            f"{directory} is not writable ({exc.strerror})",
            "point KVCLOUD_INDEX at a writable local directory (not NFS)",
        )
        return
    yield Check("index", "sqlite path", OK, f"{db} (directory writable)")


def _check_redis(client: Any) -> Iterator[Check]:
    import redis.exceptions as rexc

    try:
        info = client.info("server")
        yield Check("index", "redis version", OK, str(info.get("redis_version", "?")))
    except rexc.RedisError as exc:
        yield Check("index", "redis version", WARN, f"INFO denied: {exc}")
    try:
        policy = str(client.config_get("maxmemory-policy").get("maxmemory-policy", "?"))
        maxmemory = int(client.config_get("maxmemory").get("maxmemory", 0) or 0)
    except rexc.RedisError as exc:
        # Managed Redis often disables CONFIG; the operator must check the policy by hand.
        yield Check(
            "index",
            "maxmemory-policy",
            WARN,
            f"CONFIG GET denied ({exc})",
            "check the policy in the provider's console: use volatile-lru or noeviction",
        )
    else:
        limit = f"maxmemory {maxmemory:,} B" if maxmemory else "no maxmemory limit"
        if policy in _EVICTS_PERSISTENT:
            yield Check(
                "index",
                "maxmemory-policy",
                WARN,
                f"{policy} ({limit}): when memory is full Redis may evict keys without a TTL"
                " — kvcloud's session records and counters — so sessions silently stop"
                " resuming",
                "CONFIG SET maxmemory-policy volatile-lru (evicts only TTL'd prefix entries,"
                " which are hints) or noeviction, and size memory per docs/OPERATIONS.md",
            )
        elif policy == "noeviction" and maxmemory:
            yield Check(
                "index",
                "maxmemory-policy",
                OK,
                f"noeviction ({limit}): a full Redis rejects new entries (workers then"
                " recompute); run kvcloud gc --max-bytes to stay under it",
            )
        else:
            yield Check("index", "maxmemory-policy", OK, f"{policy} ({limit})")
    try:
        sent = time.time()
        seconds, micros = client.time()
        received = time.time()
    except rexc.RedisError as exc:
        yield Check("index", "clock skew", WARN, f"TIME failed: {exc}")
        return
    yield _skew_check("index", seconds + micros / 1e6, sent, received)


def _check_buckets(client: Any, index: Any, sample: int = 64) -> Iterator[Check]:
    """Sample the entry buckets: a bucket past hash-max-listpack-entries fields becomes a
    regular Redis hash, which takes about 1.5x the memory per entry (docs/OPERATIONS.md)."""
    import redis.exceptions as rexc

    try:
        try:
            raw = client.config_get("hash-max-listpack-entries").get("hash-max-listpack-entries")
            limit = int(raw) if raw is not None else 512
        except rexc.ResponseError:  # CONFIG disabled (managed Redis): Redis's default
            limit = 512
        keys: list[bytes] = []
        for key in client.scan_iter(match=f"{index.prefix}:h:*", count=1000):
            keys.append(key)
            if len(keys) >= sample:
                break
        if not keys:
            yield Check("index", "entry buckets", OK, "no entries yet")
            return
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hlen(key)
            pipe.object("encoding", key)
        replies = pipe.execute()
    except rexc.RedisError as exc:
        yield Check("index", "entry buckets", WARN, f"could not sample the buckets: {exc}")
        return
    sizes = [int(n) for n in replies[0::2]]
    compact = sum(1 for e in replies[1::2] if e in (b"listpack", b"ziplist", "listpack"))
    detail = (
        f"{len(keys)} buckets sampled: {max(sizes)} entries at most, "
        f"{sum(sizes) / len(sizes):.0f} on average, {compact} of {len(keys)} compact "
        f"(limit {limit} entries; {index.buckets} buckets per namespace)"
    )
    if compact < len(keys) or max(sizes) > 0.8 * limit:
        yield Check(
            "index",
            "entry buckets",
            WARN,
            detail,
            "raise ?buckets= in the index URL of every worker (a power of two, at least a"
            " namespace's entries / 400), or CONFIG SET hash-max-listpack-entries higher",
        )
    else:
        yield Check("index", "entry buckets", OK, detail)


# --- client settings ---------------------------------------------------------------------------


def check_client(cfg: KVCloudConfig) -> Iterator[Check]:
    """The fingerprint key the configuration gives (by its public id), and whether the
    secret behind it is the insecure development default."""
    kid = key_id(cfg.secret, cfg.tenant)
    if cfg.insecure_secret:
        yield Check(
            "client",
            "secret",
            WARN,
            f"KVCLOUD_SECRET is unset: the development secret, which anyone can use to "
            f"compute fingerprints (key id {kid}, tenant {cfg.tenant})",
            "set KVCLOUD_SECRET, the same on every worker, vLLM and kvcloud command",
        )
    else:
        yield Check(
            "client",
            "key id",
            INFO,
            f"{kid} (tenant {cfg.tenant}; servers that share KV show the same id)",
        )


# --- entry point -------------------------------------------------------------------------------


def run_doctor(
    store_url: str | None, index_url: str | None, cfg: KVCloudConfig, *, client: bool = True
) -> list[Check]:
    """Every check for the given URLs (None skips that side), and with ``client`` the key id
    and secret checks."""
    checks: list[Check] = list(check_client(cfg)) if client else []
    if store_url is not None:
        checks.extend(check_store(store_url, cfg))
    if index_url is not None:
        checks.extend(check_index(index_url, cfg))
    return checks


__all__ = [
    "FAIL",
    "INFO",
    "OK",
    "WARN",
    "Check",
    "check_client",
    "check_index",
    "check_store",
    "run_doctor",
]
