"""The worker's Prometheus metrics, one registry per engine."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcloud import KVCloud

log = logging.getLogger("kvcloud.worker")


class Metrics:
    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcloud_worker_requests", "Completion requests served", ["status"], registry=r
        )
        self.tokens = Counter(
            "kvcloud_worker_prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["source"],
            registry=r,
        )
        self.generated = Counter("kvcloud_worker_generated_tokens", "Tokens generated", registry=r)
        self.evictions = Counter(
            "kvcloud_worker_pages_evicted", "Pages evicted from the pool", registry=r
        )
        self.uploads = Counter(
            "kvcloud_worker_uploads", "Background page uploads", ["result"], registry=r
        )
        self.upload_bytes = Counter(
            "kvcloud_worker_upload_bytes",
            "Bytes of new objects written by the uploader",
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvcloud_worker_upload_queue_depth", "Pages waiting to upload", registry=r
        )
        self.fallbacks = Counter(
            "kvcloud_worker_remote_fallbacks",
            "Remote chunks that could not be restored and were recomputed",
            registry=r,
        )
        self.ttft = Histogram(
            "kvcloud_worker_ttft_seconds",
            "Time to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.pages = Gauge(
            "kvcloud_worker_cache_pages", "Pool pages by state", ["state"], registry=r
        )
        self.sessions = Gauge("kvcloud_worker_sessions", "Sessions held by this worker", registry=r)
        self.flushes = Counter(
            "kvcloud_worker_session_flushes", "Session flushes", ["result"], registry=r
        )
        # write-through (workers.engine.sessions): a failed write leaves the turn on this
        # worker only
        self.session_writes = Counter(
            "kvcloud_worker_session_writes",
            "Session records written at the end of a turn (write-through)",
            ["result"],
            registry=r,
        )
        # the check at the start of a turn on a resident session: current, stale (another
        # worker wrote since; restored from the record), missing, unavailable (resident used)
        self.session_checks = Counter(
            "kvcloud_worker_session_checks",
            "Resident sessions checked against the stored record",
            ["result"],
            registry=r,
        )
        self.decisions = Counter(
            "kvcloud_worker_cost_decisions",
            "Remote hits: pulled in full, in part, or recomputed",
            ["decision"],
            registry=r,
        )
        self.bandwidth = Gauge(
            "kvcloud_worker_store_bandwidth_bytes", "Learnt pull bandwidth (bytes/s)", registry=r
        )
        # Latencies of the three remote operations: lookups sit on every request's critical
        # path, pulls replace prefill, pushes run in the background (and on flush).
        self.lookup_seconds = Histogram(
            "kvcloud_worker_lookup_seconds",
            "Index lookup of a prompt's chunks (one round trip)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5),
            registry=r,
        )
        self.pull_seconds = Histogram(
            "kvcloud_worker_pull_seconds",
            "Parallel pull of matched chunks into pages",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.push_seconds = Histogram(
            "kvcloud_worker_push_seconds",
            "Push of chunks (uploader pages and session flushes)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.pulled_bytes = Counter(
            "kvcloud_worker_pulled_bytes", "Bytes of verified objects pulled", registry=r
        )
        self.pushed_bytes = Counter(
            "kvcloud_worker_pushed_bytes",
            "Bytes of new objects written (uploader and flushes)",
            registry=r,
        )
        self.pull_failures = Counter(
            "kvcloud_worker_pull_failures",
            "Matched chunks that could not be pulled, by reason (missing, corrupt, unavailable)",
            ["reason"],
            registry=r,
        )
        self.verify_failures = Counter(
            "kvcloud_worker_verify_failures",
            "Pulled objects that failed verification (digest, header, decode) and were dropped",
            registry=r,
        )
        # Every known label value starts at 0: a series that first appears already at 1 hides
        # that first increase from rate()/increase(), so a dashboard would miss it.
        for metric, values in (
            (self.requests, ("ok", "error")),
            (self.tokens, ("local", "remote", "computed")),
            (self.uploads, ("ok", "dropped", "failed")),
            (self.flushes, ("ok", "failed")),
            (self.decisions, ("restore", "partial", "recompute")),
            (self.pull_failures, ("missing", "corrupt", "unavailable")),
        ):
            for value in values:
                metric.labels(value)


class TimedPushes:
    """What the uploader sees as its client: the engine's KVCloud with push_chunks timed, so
    push latency is measured where the uploader spends it without changing the uploader."""

    def __init__(self, kv: KVCloud, metrics: Metrics) -> None:
        self._kv = kv
        self._metrics = metrics

    def push_chunks(self, *args: Any, **kwargs: Any) -> Any:
        with self._metrics.push_seconds.time():
            return self._kv.push_chunks(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)
