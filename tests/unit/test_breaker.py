"""The circuit breaker: opens after consecutive failures, lets one probe through per window,
doubles the window on a failed probe, closes on success, and says so once per change."""

from __future__ import annotations

import logging
import threading

import pytest

from kvcloud.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker("index", threshold=3, clock=Clock())
    b.failure()
    b.failure()
    b.success()  # not consecutive: starts again
    b.failure()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow() and b.opened == 1


def test_one_probe_per_window_and_the_window_doubles() -> None:
    clock = Clock()
    b = CircuitBreaker("store", threshold=1, backoff=1.0, max_backoff=3.0, clock=clock)
    b.failure()
    assert b.retry_in() == pytest.approx(1.0)
    clock.t += 1.0
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # only one probe
    b.failure()  # the probe failed: 2 s now
    assert b.state == OPEN and b.retry_in() == pytest.approx(2.0)
    clock.t += 2.0
    assert b.allow()
    b.failure()  # capped at 3 s
    assert b.retry_in() == pytest.approx(3.0)
    clock.t += 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()
    b.failure()  # back to the first window
    assert b.retry_in() == pytest.approx(1.0)


def test_each_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    changes: list[tuple[str, str]] = []
    clock = Clock()
    b = CircuitBreaker(
        "index", threshold=2, clock=clock, on_change=lambda o, n: changes.append((o, n))
    )
    with caplog.at_level(logging.WARNING, logger="kvcloud.breaker"):
        for _ in range(10):
            b.failure("ConnectionError")  # failures while open change nothing
        assert [r.getMessage() for r in caplog.records] == [
            "kvcloud index unavailable (ConnectionError): not used for 1.0s, then one probe"
        ]
        clock.t += 1
        assert b.allow()
        b.success()
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert caplog.records[-1].getMessage() == "kvcloud index reachable again: back in use"


def test_concurrent_callers_get_exactly_one_probe() -> None:
    clock = Clock()
    b = CircuitBreaker("store", threshold=1, clock=clock)
    b.failure()
    clock.t += 5
    barrier = threading.Barrier(16)
    allowed: list[bool] = []

    def call() -> None:
        barrier.wait()
        allowed.append(b.allow())

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allowed.count(True) == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker("x", threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker("x", backoff=2.0, max_backoff=1.0)


def test_one_timeout_opens_it() -> None:
    b = CircuitBreaker("store", threshold=3, clock=Clock())
    b.failure("refused")
    assert b.state == CLOSED
    b.failure("restore timed out", timeout=True)
    assert b.state == OPEN and b.opened == 1
