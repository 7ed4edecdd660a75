"""Is a remote hit worth pulling? A cost model of restore vs recompute, learnt online.

recompute(n tokens at position s) = work(n, s) × seconds-per-work-unit, where work counts the
multiply-adds of a prefill: n × (2·params + 4·layers·attn_width·(s + n/2)) — linear layers
plus attention over the growing context. Seconds per unit is an EWMA over real prefills.

restore(bytes) = overhead + bytes / bandwidth, both EWMAs over real pulls.

While the model says "recompute", nothing is pulled and so nothing is measured; a background
probe (at most one every ``probe_interval`` seconds) pulls a single chunk off the request
path so the model notices when the store recovers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .model import ModelConfig


@dataclass
class Decision:
    chunks: int  # how many of the matched chunks to pull (a prefix of them)
    restore_s: float  # estimated time to pull them
    recompute_s: float  # estimated time to prefill them instead


class CostModel:
    def __init__(
        self,
        cfg: ModelConfig,
        chunk_tokens: int,
        alpha: float = 0.3,
        probe_interval: float = 2.0,
        enabled: bool = True,
        margin: float = 0.9,
    ) -> None:
        self.cfg = cfg
        self.c = chunk_tokens
        self.alpha = alpha
        self.probe_interval = probe_interval
        self.enabled = enabled
        # restore only when estimated clearly cheaper: near a tie, estimation error decides,
        # and erring towards recompute is what keeps TTFT at or below recompute
        self.margin = margin
        n_params = cfg.n_layers * (
            cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
            + 3 * cfg.d_model * cfg.ffn_dim
        )
        self._linear = 2.0 * n_params
        self._attn = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim
        self.sec_per_unit: float | None = None
        self.bandwidth: float | None = None  # bytes/s of a parallel pull
        self.overhead: float = 0.002  # seconds per pull besides the bytes
        self._lock = threading.Lock()
        self._last_probe = 0.0

    # -- estimates --------------------------------------------------------------------------

    def work(self, n: int, start: int) -> float:
        return n * (self._linear + self._attn * (start + n / 2.0))

    def recompute_seconds(self, n: int, start: int) -> float:
        return self.work(n, start) * (self.sec_per_unit or 0.0)

    def restore_seconds(self, nbytes: int) -> float:
        if self.bandwidth is None:
            return 0.0  # nothing measured yet: try it, and learn from it
        return self.overhead + nbytes / self.bandwidth

    def decide(self, start_chunk: int, chunk_bytes: list[int]) -> Decision:
        """Pull the prefix of the matched chunks that minimises restore + recompute."""
        m = len(chunk_bytes)
        if not self.enabled or self.sec_per_unit is None or self.bandwidth is None:
            return Decision(m, 0.0, 0.0)
        start = start_chunk * self.c
        total = self.recompute_seconds(m * self.c, start)
        best_k, best_cost = 0, total
        pulled = 0
        for k in range(1, m + 1):
            pulled += chunk_bytes[k - 1]
            rest = self.recompute_seconds((m - k) * self.c, start + k * self.c)
            cost = self.restore_seconds(pulled) / self.margin + rest
            if cost < best_cost:
                best_k, best_cost = k, cost
        restore = self.restore_seconds(sum(chunk_bytes[:best_k])) if best_k else 0.0
        return Decision(best_k, restore, self.recompute_seconds(best_k * self.c, start))

    def decide_all(self, chunk_bytes: list[int]) -> Decision:
        """Pull everything (a decision made for reasons other than speed)."""
        return Decision(len(chunk_bytes), self.restore_seconds(sum(chunk_bytes)), 0.0)

    # -- learning ---------------------------------------------------------------------------

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_prefill(self, n: int, start: int, seconds: float) -> None:
        if n < 8 or seconds <= 0:
            return  # tiny prefills are all overhead and would skew the rate
        with self._lock:
            self.sec_per_unit = self._ewma(self.sec_per_unit, seconds / self.work(n, start))

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            if self.bandwidth is not None and rate < self.bandwidth / 2:
                # a store that just got much slower must stop being trusted at once: one
                # slow pull is cheap, five in a row while an average catches up are not
                self.bandwidth = rate
            else:
                self.bandwidth = self._ewma(self.bandwidth, rate)

    def should_probe(self) -> bool:
        """After choosing recompute: is it time to re-measure the store in the background?"""
        now = time.monotonic()
        with self._lock:
            if now - self._last_probe < self.probe_interval:
                return False
            self._last_probe = now
            return True

    def snapshot(self) -> dict[str, float | None]:
        return {
            "sec_per_unit": self.sec_per_unit,
            "bandwidth_bytes_per_s": self.bandwidth,
            "overhead_s": self.overhead,
        }
