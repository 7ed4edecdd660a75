"""A circuit breaker: after consecutive failures, stop calling a backend for a while.

Inside an inference engine a dead or hung index or store must cost milliseconds, not a
timeout per request: a slow index never stalls the engine. The breaker is closed while
calls succeed; after ``threshold`` consecutive failures (or one timeout) it opens and
``allow()`` answers False for a backoff window; when the window has passed exactly one
caller gets True (the probe, half-open state); the probe's success closes the breaker, its
failure opens it again for twice as long (up to ``max_backoff``). Each state change is
logged once and counted, so an outage shows as one line and one metric, not a line per
request.

Thread-safe; no backend imports. Time comes from ``clock`` so tests run without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .errors import ConfigError

log = logging.getLogger("kvcloud.breaker")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        threshold: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        if threshold < 1 or backoff <= 0 or max_backoff < backoff:
            raise ConfigError("breaker: threshold >= 1 and 0 < backoff <= max_backoff")
        self.name = name
        self.threshold = threshold
        self.base_backoff = backoff
        self.max_backoff = max_backoff
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._backoff = backoff  # the next open window
        self._reopen_at = 0.0
        self.opened = 0  # times it went from closed (or half-open) to open

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def is_open(self) -> bool:
        """Open or probing: callers other than the probe are refused."""
        return self.state != CLOSED

    def retry_in(self) -> float:
        """Seconds until the next probe may go (0 when closed or probing)."""
        with self._lock:
            if self._state != OPEN:
                return 0.0
            return max(0.0, self._reopen_at - self._clock())

    def allow(self) -> bool:
        """May a call go to the backend now? At most one caller is let through per window."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._clock() >= self._reopen_at:
                self._set(HALF_OPEN)
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state != CLOSED:
                self._backoff = self.base_backoff
                self._set(CLOSED)

    def failure(self, reason: str = "", timeout: bool = False) -> None:
        """A failed call. A ``timeout`` opens the breaker at once: it already cost its caller
        the whole wait, and the next caller would pay it again (a refused connection costs
        milliseconds, so that takes ``threshold`` in a row)."""
        with self._lock:
            if self._state == HALF_OPEN:
                # the probe failed: stay away twice as long
                self._backoff = min(self._backoff * 2, self.max_backoff)
                self._open(reason)
            elif self._state == CLOSED:
                self._failures += 1
                if timeout or self._failures >= self.threshold:
                    self._open(reason)
            # already open: a late failure of a call let through before it opened

    def _open(self, reason: str) -> None:
        self._reopen_at = self._clock() + self._backoff
        self._failures = 0
        self.opened += 1
        self._set(OPEN, reason)

    def _set(self, state: str, reason: str = "") -> None:
        old, self._state = self._state, state
        if old == state:
            return
        if state == OPEN:
            log.warning(
                "kvcloud %s unavailable%s: not used for %.1fs, then one probe",
                self.name,
                f" ({reason})" if reason else "",
                self._backoff,
            )
        elif state == CLOSED:
            log.warning("kvcloud %s reachable again: back in use", self.name)
        if self._on_change is not None:
            self._on_change(old, state)


__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "CircuitBreaker"]
