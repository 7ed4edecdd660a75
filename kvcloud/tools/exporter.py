"""Store-wide figures as Prometheus metrics: ``kvcloud stats --prometheus`` (one shot) and
``kvcloud stats --serve`` (an exporter Prometheus scrapes).

The figures need a full scan of the index and a listing of the store, which is far too slow
to run on every scrape of a large deployment. So the exporter scans on its own clock
(``--interval``) and every scrape returns the last completed scan, with
``kvcloud_stats_timestamp_seconds`` saying how old it is. A failed scan keeps the previous
figures, sets ``kvcloud_stats_up`` to 0 and counts the failure: an alert on ``up == 0`` is
how an unreachable store or index shows up on a dashboard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..errors import KVCloudError

log = logging.getLogger("kvcloud.exporter")

DEFAULT_PORT = 9108  # the kvcloud slot next to other exporters' defaults


def stats_families(result: dict[str, Any]) -> Iterator[Metric]:
    """The store-wide gauges for one ``collect_stats`` result."""
    entries = GaugeMetricFamily(
        "kvcloud_index_entries", "Index entries per namespace", None, ["ns"]
    )
    entry_bytes = GaugeMetricFamily(
        "kvcloud_index_entry_bytes", "Bytes the index entries reference", None, ["ns"]
    )
    tokens = GaugeMetricFamily(
        "kvcloud_index_entry_tokens", "Tokens the index entries cover", None, ["ns"]
    )
    for ns, d in sorted(result["namespaces"].items()):
        entries.add_metric([ns], d["entries"])
        entry_bytes.add_metric([ns], d["bytes"])
        tokens.add_metric([ns], d["tokens"])
    yield from (entries, entry_bytes, tokens)
    yield GaugeMetricFamily(
        "kvcloud_index_sessions", "Session records in the index", value=result["sessions"]
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
            "kvcloud_store_objects", "Objects in the store", value=result["objects"]
        )
        yield GaugeMetricFamily(
            "kvcloud_store_bytes", "Bytes of the objects in the store", value=result["object_bytes"]
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
    """Rescans every ``interval`` seconds in a background thread; serves the last scan."""

    def __init__(self, collect: Callable[[], dict[str, Any]], interval: float) -> None:
        if interval <= 0:
            raise KVCloudError("--interval must be positive")
        self._collect = collect
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._up = 0
        self._failures = 0
        self._scan_seconds = 0.0
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
            # KVCloudError messages are written to name the redacted URL and what to check;
            # anything else is unexpected and worth its type in the log.
            detail = str(exc) if isinstance(exc, KVCloudError) else f"{type(exc).__name__}: {exc}"
            log.warning("stats scan failed (keeping the previous figures): %s", detail)
            return False
        with self._lock:
            self._last = result
            self._up = 1
            self._scan_seconds = time.perf_counter() - t0
        return True

    def _families(self) -> Iterator[Metric]:
        with self._lock:
            last, up, failures, seconds = self._last, self._up, self._failures, self._scan_seconds
        yield GaugeMetricFamily(
            "kvcloud_stats_up", "1 if the last scan of the store and index succeeded", value=up
        )
        yield CounterMetricFamily(
            "kvcloud_stats_scan_failures", "Scans that failed", value=failures
        )
        yield GaugeMetricFamily(
            "kvcloud_stats_scan_seconds", "How long the last scan took", value=seconds
        )
        if last is not None:
            yield from stats_families(last)

    def stop(self) -> None:
        self._stop.set()

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics and rescan until :meth:`stop` (or SIGTERM via the CLI)."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise KVCloudError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        log.info("serving store-wide metrics on http://%s:%d/metrics", host, port)
        try:
            while not self._stop.is_set():
                self.scan_once()
                self._stop.wait(self.interval)
        finally:
            server.shutdown()
            thread.join(timeout=5)


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
