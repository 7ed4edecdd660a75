"""Timings into figures: throughput (best and median), kvcloud/baseline ratios, latency
percentiles.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np


def throughput_figures(nbytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "seconds": list(seconds),
        "gbps_best": nbytes / best / 1e9,
        "gbps_median": nbytes / median / 1e9,
    }


def pair_figures(kvcloud: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    return {
        "kvcloud": kvcloud,
        "baseline": baseline,
        "ratio_best": kvcloud["gbps_best"] / baseline["gbps_best"],
        "ratio_median": kvcloud["gbps_median"] / baseline["gbps_median"],
    }


def latency_figures(samples_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
    }
