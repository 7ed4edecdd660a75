"""The load benchmark's routing (scripts/bench/bench_vllm_load.py): what each policy does with the
turns in flight, since its figures are judged by where the turns went."""

from __future__ import annotations

import pytest

from scripts.bench.bench_vllm_load import Router, Turn, summarize


def test_sticky_and_round_robin_ignore_the_load() -> None:
    sticky, rr = Router("sticky", 2), Router("round-robin", 2)
    sticky.in_flight[:] = rr.in_flight[:] = [5, 0]
    assert [sticky.pick(3, k, 1) for k in range(4)] == [1, 1, 1, 1]
    assert [rr.pick(3, k, -1) for k in range(4)] == [1, 0, 1, 0]


def test_least_loaded_takes_the_idler_server_and_moves_among_equals() -> None:
    r = Router("least-loaded", 2)
    r.in_flight[:] = [1, 0]
    assert r.pick(0, 3, 1) == 1  # the idler server, even if the conversation stays
    r.in_flight[:] = [2, 2]
    assert r.pick(0, 3, 1) == 0 and r.pick(5, 2, 0) == 1  # equal load: it moves
    r.in_flight[:] = [0, 0]
    assert {r.pick(c, 0, -1) for c in range(4)} == {0, 1}  # first turns spread
    three = Router("least-loaded", 3)
    three.in_flight[:] = [1, 1, 3]
    assert three.pick(0, 1, 0) == 1  # of the two least loaded, not the last one


def test_an_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="least-loaded"):
        Router("random", 2)


def test_the_summary_counts_the_turns_that_moved() -> None:
    turns = [Turn(0, 0, 0), Turn(0, 1, 1), Turn(0, 2, 1), Turn(1, 0, 1), Turn(1, 1, 0)]
    for t in turns:
        t.ttft, t.completion_tokens = 0.1, 4
    assert summarize(turns, 1.0)["moved_fraction"] == pytest.approx(2 / 3)
