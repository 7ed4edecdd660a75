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


@dataclass
class KVCloudConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# counters every step may report, worker and scheduler side together; also the Prometheus
# metric names (``vllm:kvcloud_<name>_total``)
COUNTERS: dict[str, str] = {
    "lookups": "kvcloud index lookups made by the scheduler",
    "lookup_errors": "lookups that failed (index unreachable): served as misses",
    "lookup_timeouts": "lookups given up after lookup_timeout: served as misses",
    "lookup_deferrals": "scheduler steps a new request waited for its lookup (others ran)",
    "lookup_us": "microseconds lookups took, from the request's arrival to the index's answer",
    "lookups_skipped": "requests not looked up because the index breaker was open",
    "lookups_not_waited": "requests vLLM's own cache served fully: their lookup not waited for",
    "requests_skipped": "requests kvcloud cannot key (prompt embeddings): run without it",
    "index_breaker_opened": "times the index circuit breaker opened",
    "store_breaker_opened": "times the store circuit breaker opened",
    "loads_skipped": "hits not offered because the store breaker was open",
    "scheduler_us": "microseconds the connector spent on vLLM's scheduler thread",
    "hit_tokens": "prompt tokens offered to vLLM from kvcloud",
    "loaded_tokens": "tokens whose KV was loaded into vLLM blocks",
    "loaded_bytes": "object bytes pulled from the store",
    "loads": "restores run on the load threads",
    "loads_in_step": "restores run inside the step that scheduled them (sync, or auto when short)",
    "load_us": "microseconds restores took, pull and verify and write into vLLM's blocks",
    "load_write_us": "of load_us, microseconds writing pulled chunks into vLLM's blocks",
    "load_report_us": "microseconds finished restores waited to be reported to vLLM (async)",
    "save_us": "microseconds the forward thread spent copying chunks out for saving",
    "load_failed_blocks": "blocks vLLM was told to recompute (load failed)",
    "load_timeouts": "restores that ran past load_timeout (auto in the step: four budgets)",
    "loads_refused": "restores failed at once (store breaker open, object remembered bad)",
    "missing_objects": "objects named by the index but gone from the store",
    "verify_failures": "objects that failed verification (digest, header, decryption)",
    "store_errors": "store requests that failed (unreachable, timeout)",
    "chunks_queued": "chunks handed to the uploader",
    "chunks_pushed": "chunks newly stored by the uploader",
    "chunks_already_stored": "chunks the uploader found already in the index",
    "push_failures": "chunks the uploader could not store",
    "upload_dropped": "chunks dropped because the upload queue was full",
    "parts_pushed": "parts of chunks (a TP rank's KV heads) newly stored by the uploader",
    "chunks_registered": "chunks in parts this rank registered, its part the last stored (TP > 1)",
}


# states, reported when they change and exported as gauges (``vllm:kvcloud_<name>``)
GAUGES: dict[str, str] = {
    "index_breaker_open": "1 while the index circuit breaker is open (lookups are skipped)",
    "store_breaker_open": "1 while the store circuit breaker is open (loads are skipped)",
}


@dataclass
class KVCloudConnectorStats(KVConnectorStats):
    """Counter deltas since the last report; summed across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter({k: v for k, v in self.data.items() if k not in GAUGES})
        merged.update({k: v for k, v in other.data.items() if k not in GAUGES})
        gauges = {k: max(self.data.get(k, 0), other.data.get(k, 0)) for k in GAUGES}
        self.data = {
            **dict(merged),
            **{k: v for k, v in gauges.items() if k in self.data or k in other.data},
        }
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v or k in GAUGES}

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
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in GAUGES.items():
            gauge = self._gauge_cls(
                name=f"vllm:kvcloud_{name}",
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[name] = {idx: gauge.labels(*values) for idx, values in per_engine.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            gauge = self._gauges.get(name)
            if gauge is not None and engine_idx in gauge:
                gauge[engine_idx].set(value)
                continue
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
