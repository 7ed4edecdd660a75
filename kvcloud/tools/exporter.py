"""Store-wide figures as Prometheus metrics: ``kvcloud stats --prometheus`` (one shot, one
full scan) and ``kvcloud stats --serve`` (an exporter Prometheus scrapes).

The exporter's cost does not grow with the store: every ``--interval`` it reads the index's
own bookkeeping (live entries, bytes and tokens per namespace; ``Index.summary``), a bounded
random sample of entries (the age, idle-time and size histograms) and the counters, and it
lists nothing. Every scrape returns the last collection, with
``kvcloud_stats_timestamp_seconds`` saying how old it is. Figures that are estimated carry
the label ``estimate="true"`` and say how in their help text: the store's objects and bytes
(from the index: entries × the sample's objects per entry, and the bytes the entries name),
and on a large Redis the session count. ``--list-store-every S`` adds a full listing of the
store on that slower clock, in its own thread, for exact ``kvcloud_store_objects`` and
``kvcloud_store_bytes`` (without the label). The exporter's reads renew no TTL and, on
Redis 7.2+ and Valkey, run under ``CLIENT NO-TOUCH`` so they do not make entries look used
to ``maxmemory-policy`` (``kvcloud_stats_lru_untouched``).

A failed collection keeps the previous figures, sets ``kvcloud_stats_up`` to 0 and counts the
failure: an alert on ``up == 0`` is how an unreachable store or index shows up on a dashboard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..errors import KVCloudError
from ..indexes.base import EntryRecord

log = logging.getLogger("kvcloud.exporter")

DEFAULT_PORT = 9108  # the kvcloud slot next to other exporters' defaults

# histogram buckets: seconds (a minute to a month) and bytes (4 KiB to 1 GiB)
AGE_BUCKETS = (60, 300, 900, 3600, 4 * 3600, 86400, 3 * 86400, 7 * 86400, 30 * 86400)
SIZE_BUCKETS = tuple(4096 * 4**i for i in range(10))


def _histogram(values: list[float], bounds: Iterable[float]) -> dict[str, Any]:
    return {
        "buckets": [[b, sum(1 for v in values if v <= b)] for b in bounds],
        "count": len(values),
        "sum": float(sum(values)),
    }


def summarize_sample(
    records: Iterable[EntryRecord], ttl_seconds: float, now: float
) -> dict[str, dict[str, Any]]:
    """Per namespace: the sample's size, mean objects per entry, and histograms of age (since
    registration), idle time (since the last hit: the TTL less the time left, so at the
    renewal interval's resolution) and entry bytes."""
    by_ns: dict[str, list[EntryRecord]] = {}
    for rec in records:
        by_ns.setdefault(rec.ns, []).append(rec)
    out: dict[str, dict[str, Any]] = {}
    for ns, recs in sorted(by_ns.items()):
        idle = [
            max(0.0, ttl_seconds - (r.expires_at - now)) for r in recs if r.expires_at is not None
        ]
        out[ns] = {
            "entries": len(recs),
            "objects_per_entry": sum(len(r.entry.keys) for r in recs) / len(recs),
            "age_seconds": _histogram([max(0.0, now - r.entry.created) for r in recs], AGE_BUCKETS),
            "idle_seconds": _histogram(idle, AGE_BUCKETS),
            "entry_bytes": _histogram([float(r.entry.size) for r in recs], SIZE_BUCKETS),
        }
    return out


def _gauge(name: str, doc: str, value: float, estimate: bool) -> GaugeMetricFamily:
    """An unlabelled gauge, or one labelled ``estimate="true"`` when it is estimated."""
    if not estimate:
        return GaugeMetricFamily(name, doc, value=value)
    family = GaugeMetricFamily(name, doc, labels=["estimate"])
    family.add_metric(["true"], value)
    return family


def _sample_families(sample: dict[str, dict[str, Any]], size: int) -> Iterator[Metric]:
    what = (
        f"in a random sample of the index's live entries (at most {size} per namespace; the "
        "share per bucket estimates the whole index's)"
    )
    docs = {
        "age_seconds": f"Seconds since registration of the entries {what}",
        "idle_seconds": f"Seconds since the last hit (TTL renewal) of the entries {what}: the "
        "TTL less the time left, so at the renewal interval's resolution (a hundredth of the "
        "TTL, at most a minute), with the exporter's TTL taken to be the workers'",
        "entry_bytes": f"Bytes of the objects each entry names, for the entries {what}",
    }
    for key, doc in docs.items():
        family = HistogramMetricFamily(f"kvcloud_index_sample_{key}", doc, labels=["ns"])
        for ns, d in sample.items():
            h = d[key]
            buckets = [(floatToGoString(b), c) for b, c in h["buckets"]]
            buckets.append(("+Inf", h["count"]))
            family.add_metric([ns], buckets, h["sum"])
        yield family


def stats_families(result: dict[str, Any]) -> Iterator[Metric]:
    """The store-wide gauges for one ``collect_stats`` (full scan) or ``collect_summary``
    (bookkeeping) result."""
    how = (
        " (from the index's bookkeeping: no scan)"
        if result.get("source") == "bookkeeping"
        else " (from a full scan)"
    )
    entries = GaugeMetricFamily(
        "kvcloud_index_entries", "Live index entries per namespace" + how, None, ["ns"]
    )
    entry_bytes = GaugeMetricFamily(
        "kvcloud_index_entry_bytes", "Bytes the live index entries reference" + how, None, ["ns"]
    )
    tokens = GaugeMetricFamily(
        "kvcloud_index_entry_tokens", "Tokens the live index entries cover" + how, None, ["ns"]
    )
    for ns, d in sorted(result["namespaces"].items()):
        entries.add_metric([ns], d["entries"])
        entry_bytes.add_metric([ns], d["bytes"])
        tokens.add_metric([ns], d["tokens"])
    yield from (entries, entry_bytes, tokens)
    exact_sessions = result.get("sessions_exact", True)
    yield _gauge(
        "kvcloud_index_sessions",
        "Session records in the index"
        + (
            ""
            if exact_sessions
            else " (estimate: the share of session keys among RANDOMKEYs × DBSIZE)"
        ),
        result["sessions"],
        not exact_sessions,
    )
    # The index keeps these counters monotonic, but the exporter only reads snapshots of
    # them, so they are gauges; rate()/deriv() over successive snapshots still works.
    counter = GaugeMetricFamily(
        "kvcloud_index_counter", "Cumulative counters kept in the index", None, ["name"]
    )
    for name, value in sorted(result["counters"].items()):
        counter.add_metric([name], value)
    yield counter
    if "objects" in result:
        yield GaugeMetricFamily(
            "kvcloud_store_objects", "Objects in the store (listed)", value=result["objects"]
        )
        yield GaugeMetricFamily(
            "kvcloud_store_bytes",
            "Bytes of the objects in the store (listed)",
            value=result["object_bytes"],
        )
    elif "objects_estimate" in result:
        yield _gauge(
            "kvcloud_store_objects",
            "Objects in the store (estimate: the live entries × the sampled objects per entry; "
            "objects no live entry names, such as session tails and those gc has not yet "
            "deleted, are not counted; --list-store-every lists the store)",
            result["objects_estimate"],
            True,
        )
        yield _gauge(
            "kvcloud_store_bytes",
            "Bytes of the objects in the store (estimate: the bytes the live entries name; "
            "--list-store-every lists the store)",
            result["object_bytes_estimate"],
            True,
        )
    if "sample" in result:
        yield from _sample_families(result["sample"], result.get("sample_size", 0))
    if result.get("bookkeeping_since"):
        since = GaugeMetricFamily(
            "kvcloud_index_bookkeeping_since_seconds",
            "Unix time the index began keeping this namespace's figures (Redis): entries "
            "written before it and not renewed since are not counted, so the figures are "
            "complete from one TTL after it",
            None,
            ["ns"],
        )
        for ns, t in sorted(result["bookkeeping_since"].items()):
            since.add_metric([ns], t)
        yield since
    if result.get("lru_untouched") is not None:
        yield GaugeMetricFamily(
            "kvcloud_stats_lru_untouched",
            "1 if the exporter's reads leave Redis's LRU/LFU clocks untouched (CLIENT NO-TOUCH, "
            "Redis 7.2+ and Valkey); 0 if the server refused it and every read marks a bucket "
            "as used",
            value=1 if result["lru_untouched"] else 0,
        )
    yield GaugeMetricFamily(
        "kvcloud_stats_timestamp_seconds",
        "Unix time the figures were collected",
        value=result["collected_at"],
    )


class _Families(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return list(self._families())


def prometheus_text(result: dict[str, Any]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(lambda: stats_families(result)))
    return generate_latest(registry).decode("utf-8")


class StatsExporter:
    """Collects every ``interval`` seconds in a background thread and serves the last
    collection; with ``list_store`` and ``list_interval``, also lists the store every
    ``list_interval`` seconds in a thread of its own (exact store figures, O(store))."""

    def __init__(
        self,
        collect: Callable[[], dict[str, Any]],
        interval: float,
        *,
        list_store: Callable[[], dict[str, Any]] | None = None,
        list_interval: float = 0.0,
    ) -> None:
        if interval <= 0:
            raise KVCloudError("--interval must be positive")
        if list_store is not None and list_interval <= 0:
            raise KVCloudError("--list-store-every must be positive")
        self._collect = collect
        self.interval = interval
        self._list_store = list_store
        self.list_interval = list_interval
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._up = 0
        self._failures = 0
        self._scan_seconds = 0.0
        self._listing: dict[str, Any] | None = None  # objects, object_bytes, at, seconds
        self._list_failures = 0
        self._stop = threading.Event()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Families(self._families))

    def scan_once(self) -> bool:
        t0 = time.perf_counter()
        try:
            result = self._collect()
        except Exception as exc:  # a failed scan must not kill the exporter
            with self._lock:
                self._up = 0
                self._failures += 1
                self._scan_seconds = time.perf_counter() - t0
            log.warning("stats scan failed (keeping the previous figures): %s", _detail(exc))
            return False
        with self._lock:
            self._last = result
            self._up = 1
            self._scan_seconds = time.perf_counter() - t0
        return True

    def list_once(self) -> bool:
        """One listing of the store (``list_store``); False if it failed."""
        assert self._list_store is not None
        t0 = time.perf_counter()
        try:
            listed = self._list_store()
        except Exception as exc:
            with self._lock:
                self._list_failures += 1
            log.warning("store listing failed (keeping the previous figures): %s", _detail(exc))
            return False
        listing = {**listed, "at": time.time(), "seconds": time.perf_counter() - t0}
        with self._lock:
            self._listing = listing
        return True

    def _families(self) -> Iterator[Metric]:
        with self._lock:
            last, up, failures, seconds = self._last, self._up, self._failures, self._scan_seconds
            listing, list_failures = self._listing, self._list_failures
        yield GaugeMetricFamily(
            "kvcloud_stats_up", "1 if the last collection of the figures succeeded", value=up
        )
        yield CounterMetricFamily(
            "kvcloud_stats_scan_failures", "Collections that failed", value=failures
        )
        yield GaugeMetricFamily(
            "kvcloud_stats_scan_seconds", "How long the last collection took", value=seconds
        )
        if self._list_store is not None:
            yield CounterMetricFamily(
                "kvcloud_stats_store_list_failures",
                "Listings of the store that failed",
                value=list_failures,
            )
        if listing is not None:
            yield GaugeMetricFamily(
                "kvcloud_stats_store_list_timestamp_seconds",
                "Unix time the last completed listing of the store finished",
                value=listing["at"],
            )
            yield GaugeMetricFamily(
                "kvcloud_stats_store_list_seconds",
                "How long the last completed listing of the store took",
                value=listing["seconds"],
            )
        if last is not None:
            if listing is not None:  # the listed figures replace the estimates
                last = {k: v for k, v in last.items() if not k.startswith("object")}
                last.update(objects=listing["objects"], object_bytes=listing["object_bytes"])
            yield from stats_families(last)

    def stop(self) -> None:
        self._stop.set()

    def _list_loop(self) -> None:
        while not self._stop.is_set():
            self.list_once()
            self._stop.wait(self.list_interval)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics and collect until :meth:`stop` (or SIGTERM via the CLI)."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise KVCloudError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        log.info("serving store-wide metrics on http://%s:%d/metrics", host, port)
        if self._list_store is not None:
            lister = threading.Thread(
                target=self._list_loop, name="kvcloud-store-list", daemon=True
            )
            lister.start()
        try:
            while not self._stop.is_set():
                self.scan_once()
                self._stop.wait(self.interval)
        finally:
            server.shutdown()
            thread.join(timeout=5)
            # a listing in progress is not waited for: it is a daemon thread


def _detail(exc: Exception) -> str:
    # KVCloudError messages are written to name the redacted URL and what to check; anything
    # else is unexpected and worth its type in the log.
    return str(exc) if isinstance(exc, KVCloudError) else f"{type(exc).__name__}: {exc}"


def parse_listen(value: str) -> tuple[str, int]:
    """``PORT``, ``:PORT`` or ``HOST:PORT``; the host defaults to 127.0.0.1 (not every
    interface: the figures name namespaces, which an operator may not want public)."""
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise KVCloudError(f"--serve wants [HOST:]PORT, got {value!r}") from None
    if not 0 < port < 65536:
        raise KVCloudError(f"--serve port out of range: {port}")
    return host, port
