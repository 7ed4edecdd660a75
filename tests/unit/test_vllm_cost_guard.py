"""The cost guard (cost.py): a hit is loaded only where restoring it is expected to beat
computing it, from the rates the workers measure; before they are measured, as before.

The scheduler side runs on a real file store and SQLite index (four stored 16-token
chunks); the expected ends are worked out by hand from the rates reported, not by the
guard's own arithmetic. The worker side's pass timing runs on CPU tensors.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcloud import KVCloud
from kvcloud.integrations.vllm import cost
from kvcloud.integrations.vllm.specs import KVCloudWorkerMeta
from tests.unit.test_vllm_scheduler import C, ask, request, side, stored  # noqa: F401
from tests.unit.test_vllm_worker_loads import _Clock
from tests.unit.test_vllm_worker_loads import meta as step_meta
from tests.unit.test_vllm_worker_loads import setup as worker_setup


def report(s, **fields: float) -> None:  # type: ignore[no-untyped-def]
    meta = KVCloudWorkerMeta(**fields)  # type: ignore[arg-type]
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))


def chunk_bytes(kvc: KVCloud, tokens: list[int]) -> int:
    (size,) = {ref.entry.size for ref in kvc.lookup(side(kvc).ns, tokens).chunks}
    return size


def test_paying_end_by_hand() -> None:
    # 4 chunks of 16 tokens, 1,000 bytes each; prefill 1,000 tokens/s (16 ms a chunk)
    chunks = [(p, 1000) for p in range(4)]
    # restore at 100 kB/s: 10 ms a chunk; with margin 1.25, 12.5 ms <= 16 ms: all of it
    assert cost.paying_end(0, 64, C, chunks, 1000.0, 100_000.0, 1.25) == 64
    # at 50 kB/s: 20 ms × 1.25 = 25 ms > 16 ms for every chunk: none
    assert cost.paying_end(0, 64, C, chunks, 1000.0, 50_000.0, 1.25) == 0
    # vLLM holds 8 tokens: [8, 16) pulls a whole chunk for 8 tokens (12.5 ms > 8 ms: no),
    # [8, 32) two for 24 (25 > 24: no), [8, 48) three for 40 (37.5 <= 40: yes), and
    # [8, 64) four for 56 (50 <= 56: yes)
    assert cost.paying_end(8, 64, C, chunks, 1000.0, 100_000.0, 1.25) == 64
    # a hit cut at 56 (the prompt's last block is computed), 80 kB/s (12.5 ms a chunk),
    # margin 1: [0, 56) pulls four chunks for 56 tokens (50 <= 56: yes)
    assert cost.paying_end(0, 56, C, chunks, 1000.0, 80_000.0, 1.0) == 56
    # at 70 kB/s (14.3 ms a chunk): [0, 56) 57.1 > 56 no; [0, 48) 42.9 <= 48 yes
    assert cost.paying_end(0, 56, C, chunks, 1000.0, 70_000.0, 1.0) == 48
    assert cost.first_chunk_end(8, 64, C) == 16 and cost.first_chunk_end(0, 8, C) == 8


def test_rates_average_and_a_given_up_restore_caps_them() -> None:
    assert cost.moved(None, 300, 1.0) == 300
    assert cost.moved(300.0, 600, 1.0) == 400  # a third of the way
    assert cost.moved(300.0, 0, 1.0) == 300
    assert cost.capped(1e9, 4e6, 2.0) == 2e6
    assert cost.capped(1e6, 4e6, 2.0) == 1e6
    assert cost.capped(None, 4e6, 2.0) == 2e6
    assert cost.capped(1e6, 0, 2.0) == 0  # nothing came: nothing pays
    assert cost.paying_end(0, 64, C, [(0, 1)], 1000.0, 0.0, 1.25) == 0


def test_the_scheduler_loads_only_what_pays(stored: tuple[KVCloud, list[int]]) -> None:  # noqa: F811
    kvc, tokens = stored
    clock = _Clock()
    # (restores beside the pass: which mode a load takes is load_mode's business)
    s = side(kvc, cost_margin=1.25, cost_reprobe_s=60.0, load_mode="async")
    s._clock = clock
    size = chunk_bytes(kvc, tokens)

    def offer(rid: str, local: int = 0, prompt: list[int] = tokens) -> int:
        req = request(rid, prompt)
        s.on_new_request(req)
        return ask(s, req, local)

    # nothing measured: everything loaded, as before the guard
    assert offer("a") == 4 * C
    report(s, pass_tokens=1000, pass_s=1.0)  # prefill: 1,000 tokens/s, 16 ms a chunk
    assert offer("b") == 4 * C  # still no restore rate
    report(s, beside_bytes=4 * size, beside_s=0.04)  # 10 ms a chunk: 12.5 ms with the margin
    assert offer("c") == 4 * C
    # vLLM holds 8 tokens: the first chunk would be pulled whole for 8 of them, but the
    # hit as a whole still pays (see test_paying_end_by_hand)
    assert offer("d", local=8) == 4 * C - 8
    assert "hits_skipped_by_cost" not in s.take_stats()
    # a restore given up at its timeout: one chunk's bytes came in its 2 s (a throttled
    # store); the rate is capped at half a chunk a second, far below the break-even
    report(s, given_up_bytes=size, given_up_s=2.0)
    assert offer("e") == 0
    stats = s.take_stats()
    assert stats["hits_skipped_by_cost"] == 1
    assert stats["hit_tokens_skipped_by_cost"] == 4 * C
    # no report for a while: one hit loads its first chunk (the rate is measured again)
    clock.t += 61
    assert offer("f") == C
    assert s.take_stats()["cost_probes"] == 1
    assert offer("g") == 0  # the next one is skipped again
    assert s.take_stats()["hits_skipped_by_cost"] == 1
    # the probe's restore comes back fast: back to loading (the average recovers)
    for _ in range(8):
        report(s, beside_bytes=size, beside_s=0.001)
    assert offer("h") == 4 * C
    # a prompt of exactly four chunks: its last block is computed, so the fourth chunk
    # would be pulled whole for 8 tokens. At 1 ms a chunk that still pays...
    assert offer("i", prompt=tokens[: 4 * C]) == 4 * C - 8
    # ...at 12 ms a chunk (15 with the margin; 16 ms to compute one) three chunks pay,
    # [0, 48): 45 <= 48 ms, but not the fourth for its 8 tokens, [0, 56): 60 > 56 ms
    s._rate_beside = size / 0.012
    assert offer("j", prompt=tokens[: 4 * C]) == 3 * C
    stats = s.take_stats()
    assert stats["hits_skipped_by_cost"] == 1 and stats["hit_tokens_skipped_by_cost"] == 8


def test_a_store_that_delivered_nothing_is_probed_beside_the_pass(
    stored: tuple[KVCloud, list[int]],  # noqa: F811
) -> None:
    """A restore given up with nothing received caps the rate at 0: nothing pays, and the
    probe (load_mode=auto) runs beside the pass, never priced by dividing by that 0."""
    kvc, tokens = stored
    clock = _Clock()
    s = side(kvc, load_mode="auto")
    s._clock = clock
    report(s, pass_tokens=1000, pass_s=1.0)
    report(s, beside_bytes=1 << 20, beside_s=0.01, in_step_bytes=1 << 20, in_step_s=0.01)
    report(s, given_up_bytes=0, given_up_s=2.0)
    req = request("z", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 0
    clock.t += 61
    req = request("z2", tokens)
    s.on_new_request(req)
    assert ask(s, req) == C  # the probe, asynchronous
    assert s.take_stats()["cost_probes"] == 1


def test_margin_zero_turns_the_guard_off(stored: tuple[KVCloud, list[int]]) -> None:  # noqa: F811
    kvc, tokens = stored
    s = side(kvc, cost_margin=0, load_mode="async")
    report(s, pass_tokens=1000, pass_s=1.0)
    report(s, given_up_bytes=1 << 30, given_up_s=100.0)
    req = request("x", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C
    assert "hits_skipped_by_cost" not in s.take_stats()


def test_the_worker_times_prefill_passes_only(tmp_path: Path) -> None:
    """A pass of at least a chunk of tokens, without a restore in it, is timed from
    ``pass_begins`` (vLLM binding the metadata) to ``wait_for_save``; decode-sized passes
    and passes that wait for a restore are not (their time is not compute)."""
    ws, _, _, spec = worker_setup(tmp_path)
    ws.pass_begins(SimpleNamespace(**vars(step_meta()), tokens=32))  # type: ignore[arg-type]
    time.sleep(0.05)
    ws.wait_for_save()
    meta = ws.build_worker_meta()
    assert meta is not None and meta.pass_tokens == 32
    assert 0.05 <= meta.pass_s < 5
    assert ws.build_worker_meta() is None  # reported once
    ws.pass_begins(SimpleNamespace(**vars(step_meta()), tokens=8))  # type: ignore[arg-type]
    ws.wait_for_save()
    assert ws.build_worker_meta() is None  # a decode-sized pass
    spec.sync = True
    ws.pass_begins(SimpleNamespace(**vars(step_meta(spec)), tokens=64))  # type: ignore[arg-type]
    ws.wait_for_save()
    assert ws.build_worker_meta() is None  # a restore in it
    # the timer stops where the pass's work is issued (V1: start_load_kv after the pass;
    # V2: finish_forward), not at wait_for_save after sampling and a drafter's pass
    ws.pass_begins(SimpleNamespace(**vars(step_meta()), tokens=32))  # type: ignore[arg-type]
    time.sleep(0.02)
    ws.start_load_kv(step_meta())  # type: ignore[arg-type]
    time.sleep(0.3)  # sampling, the drafter
    ws.wait_for_save()
    meta = ws.build_worker_meta()
    assert meta is not None and 0.02 <= meta.pass_s < 0.3
    # two ranks' reports add up
    total = KVCloudWorkerMeta(pass_tokens=32, pass_s=0.5).aggregate(
        KVCloudWorkerMeta(pass_tokens=32, pass_s=0.5, given_up_bytes=7, given_up_s=2.0)
    )
    assert (total.pass_tokens, total.pass_s, total.given_up_bytes) == (64, 1.0, 7)


@pytest.mark.parametrize("bad", [-1, "x", True])
def test_bad_margins_are_refused(bad: object) -> None:
    from kvcloud.errors import ConfigError
    from kvcloud.integrations.vllm.config import VLLMConnectorConfig

    with pytest.raises(ConfigError, match="cost_margin"):
        VLLMConnectorConfig(cost_margin=bad)  # type: ignore[arg-type]
