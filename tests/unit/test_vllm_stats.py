"""What each side of the connector reports between two of vLLM's asks (stats.py): counter
deltas, every observation for the histograms (bounded), and gauges sent when they change or
while they are not 0, so a step's max over tensor-parallel ranks is the busiest rank's."""

from __future__ import annotations

import threading

from kvcloud.integrations.vllm.stats import MAX_OBSERVATIONS, SideStats


def test_counts_and_observations_are_taken_once() -> None:
    s = SideStats()
    s.count(loads=1, load_us=5)
    s.count(loads=2)
    s.observe("restore_seconds", 0.5)
    s.observe("restore_seconds", 0.25)
    assert s.take() == {"loads": 3, "load_us": 5, "restore_seconds": [0.5, 0.25]}
    assert s.take() == {}


def test_observations_are_bounded_when_nobody_reads_them() -> None:
    s = SideStats()
    for i in range(MAX_OBSERVATIONS + 50):
        s.observe("lookup_seconds", i)
    assert len(s.take()["lookup_seconds"]) == MAX_OBSERVATIONS


def test_a_gauge_is_sent_on_change_and_while_not_zero() -> None:
    s = SideStats()
    assert s.take({"upload_queue_depth": 0}) == {}  # 0 from the start: nothing to say
    assert s.take({"upload_queue_depth": 3}) == {"upload_queue_depth": 3}
    assert s.take({"upload_queue_depth": 3}) == {"upload_queue_depth": 3}  # still busy
    assert s.take({"upload_queue_depth": 0}) == {"upload_queue_depth": 0}  # back to idle
    assert s.take({"upload_queue_depth": 0}) == {}


def test_threads_lose_no_count() -> None:
    s = SideStats()

    def work() -> None:
        for _ in range(1000):
            s.count(chunks_queued=1)
            s.observe("upload_seconds", 0.1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = s.take()
    assert out["chunks_queued"] == 4000 and len(out["upload_seconds"]) == 4000
