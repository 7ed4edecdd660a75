"""What the scheduler side tells the worker side each step, and the counters sent back.

The metadata is serialized every step, so it carries ids and keys, never tensors: the
scheduler's one index lookup already found the object keys, so the worker pulls without a
second round trip and never needs the tenant key.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .specs import LoadSpec, SaveSpec
from .startup import INFO_LABELS, info_labels


@dataclass
class KVCloudConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tokens: int = 0  # the step's scheduled tokens (specs.StepSpec.tokens)


# counters every step may report, worker and scheduler side together; also the Prometheus
# metric names (``vllm:kvcloud_<name>_total``)
COUNTERS: dict[str, str] = {
    "lookups": "kvcloud index lookups made by the scheduler",
    "lookup_errors": "lookups that failed (index unreachable): served as misses",
    "lookup_timeouts": "lookups given up after lookup_timeout: served as misses",
    "lookup_queue_timeouts": "of those, lookups still queued behind others (not the index's fault)",
    "lookup_deferrals": "scheduler steps a new request waited for its lookup (others ran)",
    "lookup_us": "microseconds lookups took, from the request's arrival to the index's answer",
    "lookups_skipped": "requests not looked up because the index breaker was open",
    "lookups_not_waited": "requests vLLM's own cache served fully: their lookup not waited for",
    "chunks_backfilled": "chunks vLLM's cache held that the index lacked, saved once it answered",
    "loads_failed_recomputed": "requests whose restore failed from its first block: recomputed",
    "saves_rewound": "requests vLLM rewound (a restore in the step failed): chunks saved again",
    "connector_errors": "exceptions caught in a call from vLLM (logged; the call fell back)",
    "requests_skipped": "requests kvcloud cannot key (prompt embeddings): run without it",
    "index_breaker_opened": "times the index circuit breaker opened",
    "store_breaker_opened": "times the store circuit breaker opened",
    "loads_skipped": "hits not offered because the store breaker was open",
    "hits_skipped_by_cost": "hits (or their tail) not loaded: restoring was expected slower",
    "hit_tokens_skipped_by_cost": "tokens of those hits computed instead of restored",
    "cost_probes": "hits whose first chunk loaded while the guard skipped all (rate re-measured)",
    "scheduler_us": "microseconds the connector spent on vLLM's scheduler thread",
    "hit_tokens": "prompt tokens offered to vLLM from kvcloud",
    "loaded_tokens": "tokens whose KV was loaded into vLLM blocks",
    "loaded_bytes": "object bytes pulled from the store",
    "loads": "restores run on the load threads",
    "loads_in_step": "restores run inside the step that scheduled them (sync, or auto when short)",
    "load_us": "microseconds restores took, pull and verify and write into vLLM's blocks",
    "load_write_us": "of load_us, microseconds writing pulled chunks into vLLM's blocks",
    "load_write_cpu_us": "of load_write_us, CPU microseconds of the writing threads (the rest "
    "waited for a core)",
    "load_report_us": "microseconds finished restores waited to be reported to vLLM (async)",
    "save_us": "microseconds the forward thread spent copying chunks out for saving",
    "load_failed_blocks": "blocks vLLM was told to recompute (load failed)",
    "restores_failed_whole": "restores of a model with several KV cache groups that failed: "
    "the request recomputed whole",
    "load_timeouts": "restores that ran past load_timeout (auto in the step: four budgets)",
    "pulls_stopped": "pulls of restores given up, stopped at a layer instead of read to the end",
    "loads_refused": "restores failed at once (store breaker open, object remembered bad)",
    "load_queue_timeouts": "restores given up still queued on this worker: not blamed on the store",
    "missing_objects": "objects named by the index but gone from the store",
    "verify_failures": "objects that failed verification (digest, header, decryption)",
    "damaged_deleted": "objects whose bytes did not match their key, deleted after their entry",
    "store_errors": "store requests that failed (unreachable, timeout)",
    "chunks_queued": "chunks handed to the uploader",
    "chunks_pushed": "chunks newly stored by the uploader",
    "chunks_already_stored": "chunks the uploader found already in the index",
    "push_failures": "chunks the uploader could not store",
    "pushed_bytes": "object bytes the uploader stored (a part found already stored counts)",
    "upload_dropped": "chunks dropped because the upload queue was full",
    # counted by the worker as it stops, after its last report: on /metrics only where the
    # engine reports again (never after a server's stop); the stop's log line says it too
    "upload_dropped_at_stop": "chunks still unstored when the stop's drain budget ran out",
    "saves_skipped": "chunks named for saving but not saved (partly out of a sliding window, "
    "unreadable)",
    "parts_pushed": "parts of chunks (a TP rank's KV heads) newly stored by the uploader",
    "chunks_registered": "chunks in parts this rank registered, its part the last stored (TP > 1)",
}


# observations, each step's sent as a list and exported as histograms
# (``vllm:kvcloud_<name>``): name -> (documentation, bucket upper bounds)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES = tuple(float(2**n) for n in range(16, 34, 2))  # 64 KiB to 8 GiB, ×4

HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "lookup_seconds": (
        "seconds from a request's arrival to the index's answer to its lookup (scheduler)",
        _SECONDS,
    ),
    "restore_seconds": (
        "seconds a restore beside the forward pass took: pull, verify, write into vLLM's "
        "blocks (the request waited this long; the batch did not)",
        _SECONDS,
    ),
    "restore_in_step_seconds": (
        "seconds a restore inside the step took (every request of the batch waited for it)",
        _SECONDS,
    ),
    "restore_bytes": ("object bytes one restore pulled from the store", _BYTES),
    "save_seconds": (
        "seconds vLLM's forward thread spent in a step copying chunks out for saving",
        _SECONDS,
    ),
    "upload_seconds": (
        "seconds from a chunk taken off the upload queue to stored and registered",
        (*_SECONDS, 30.0),
    ),
    "save_lag_seconds": (
        "seconds from a chunk's last token computed (the end of its step) to its entry "
        "visible in the index; a next turn sent sooner misses that chunk",
        (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    ),
}


# states, reported when they change and exported as gauges (``vllm:kvcloud_<name>``)
GAUGES: dict[str, str] = {
    "index_breaker_open": "1 while the index circuit breaker is open (lookups are skipped)",
    "store_breaker_open": "1 while the store circuit breaker is open (loads are skipped)",
    "upload_queue_depth": "chunks waiting for upload or being pushed (the busiest worker)",
    "restores_in_flight": "restores submitted and not yet ended (the busiest worker)",
}


@dataclass
class KVCloudConnectorStats(KVConnectorStats):
    """Counter deltas since the last report; summed across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        plain = (GAUGES, HISTOGRAMS)
        merged = Counter({k: v for k, v in self.data.items() if not _in(k, plain)})
        merged.update({k: v for k, v in other.data.items() if not _in(k, plain)})
        gauges = {k: max(self.data.get(k, 0), other.data.get(k, 0)) for k in GAUGES}
        lists = {
            k: list(self.data.get(k) or []) + list(other.data.get(k) or [])
            for k in HISTOGRAMS
            if k in self.data or k in other.data
        }
        self.data = {
            **dict(merged),
            **{k: v for k, v in gauges.items() if k in self.data or k in other.data},
            **lists,
        }
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if k in HISTOGRAMS:  # for vLLM's log line: how many, and the worst
                if v:
                    out[f"{k}_count"], out[f"{k}_max"] = len(v), round(max(v), 4)
            elif v or k in GAUGES:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not self.data


class KVCloudPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvcloud_*_total`` counters on vLLM's own ``/metrics``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:kvcloud_{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine.items()
            }
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, (doc, buckets) in HISTOGRAMS.items():
            hist = self._histogram_cls(
                name=f"vllm:kvcloud_{name}",
                documentation=doc,
                buckets=list(buckets),
                labelnames=labelnames,
            )
            self._histograms[name] = {
                idx: hist.labels(*values) for idx, values in per_engine.items()
            }
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in GAUGES.items():
            gauge = self._gauge_cls(
                name=f"vllm:kvcloud_{name}",
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[name] = {idx: gauge.labels(*values) for idx, values in per_engine.items()}
        # which servers share: the same key id, store and index (startup.identity)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        ident = info_labels(getattr(transfer, "kv_connector_extra_config", None))
        info = self._gauge_cls(
            name="vllm:kvcloud_info",
            documentation="1 per engine; kvcloud's version, key id (servers with the same "
            "one share), store, index, tenant, load mode and write policy as labels",
            labelnames=[*labelnames, *INFO_LABELS],
            multiprocess_mode="mostrecent",
        )
        for values in per_engine.values():
            info.labels(*values, *(ident[k] for k in INFO_LABELS)).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            hist = self._histograms.get(name)
            if hist is not None:
                if engine_idx in hist:
                    for seconds in value or ():
                        hist[engine_idx].observe(seconds)
                continue
            gauge = self._gauges.get(name)
            if gauge is not None and engine_idx in gauge:
                gauge[engine_idx].set(value)
                continue
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


def _in(key: str, tables: tuple[dict[str, Any], ...]) -> bool:
    return any(key in t for t in tables)
