"""What each side of the connector reports to vLLM's metrics between two reports: counter
deltas, observations for the histograms, and gauges.

vLLM asks each side for its stats once per engine step (``get_kv_connector_stats``) and sums
what the workers of a step send (``KVCloudConnectorStats.aggregate``). A gauge is sent when
its value changed or while it is not 0: a tensor-parallel rank whose queue is unchanged
and empty sends nothing, so a step's max over the ranks is the busiest rank's value.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

# observations of one kind kept between two reports at most: bounded if nobody reads them
MAX_OBSERVATIONS = 10_000


class SideStats:
    """Counters, observations and gauges of one side (scheduler or worker), thread-safe:
    lookup, load and upload threads report as well as vLLM's own thread."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._observed: dict[str, list[float]] = {}
        self._gauges: dict[str, float] = {}

    def count(self, **deltas: int) -> None:
        with self._lock:
            self.counts.update(deltas)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            values = self._observed.setdefault(name, [])
            if len(values) < MAX_OBSERVATIONS:
                values.append(float(value))

    def take(self, gauges: dict[str, float] | None = None) -> dict[str, Any]:
        """Everything since the last call, with ``gauges``' current values where sent."""
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
            self.counts.clear()
            out.update({k: v for k, v in self._observed.items() if v})
            self._observed = {}
        for name, value in (gauges or {}).items():
            if value or value != self._gauges.get(name, 0):
                out[name] = self._gauges[name] = value
        return out
