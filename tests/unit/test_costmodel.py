"""The cost model: decisions from measured speeds, and re-learning through probes."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine
from workers.engine.costmodel import CostModel
from workers.engine.model import preset

C = 16


def test_decisions_follow_the_measured_speeds() -> None:
    cm = CostModel(preset("small"), 256)
    chunk = 256 * 12 * 1024
    assert cm.decide(0, [chunk] * 4).chunks == 4  # nothing measured: try it and learn
    cm.observe_prefill(256, 0, 0.3)  # ~0.3 s per 256-token chunk
    cm.observe_pull(16 * chunk, 0.05)  # ~1 GB/s
    assert cm.decide(0, [chunk] * 4).chunks == 4
    cm.observe_pull(chunk, chunk / 10e6)  # the store drops to 10 MB/s: trusted at once
    assert cm.bandwidth is not None and cm.bandwidth < 11e6
    assert cm.decide(0, [chunk]).chunks == 0  # 0.31 s to pull vs 0.3 s to recompute
    # deep in a long context the same chunk costs more to recompute: pulling wins again
    assert cm.decide(30, [chunk]).chunks == 1
    assert cm.recompute_seconds(256, 0) < cm.recompute_seconds(256, 4096)


def test_probe_interval_limits_background_probes() -> None:
    cm = CostModel(preset("tiny"), C, probe_interval=0.2)
    assert cm.should_probe() and not cm.should_probe()
    time.sleep(0.25)
    assert cm.should_probe()


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, n)]


def test_engine_recomputes_on_a_slow_store_and_relearns(tmp_path: Path) -> None:
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    # the small preset: recomputing a chunk clearly costs more than pulling it from disk
    pusher = Engine(
        WorkerOptions(
            model="small",
            chunk_tokens=C,
            cache_pages=32,
            store=store,
            index=index,
            write_policy="write-through",
        )
    )
    prompts = [_prompt(8 * C, s) for s in range(3)]
    for p in prompts:
        pusher.complete(CompletionRequest(prompt_tokens=p, max_tokens=1))
    assert pusher.uploader is not None and pusher.uploader.drain(10)
    e = Engine(
        WorkerOptions(model="small", chunk_tokens=C, cache_pages=32, store=store, index=index)
    )
    e.cost.probe_interval = 0.0
    # pretend the store is crawling: the model must recompute instead of pulling
    e.cost.bandwidth = 1.0
    r = e.complete(CompletionRequest(prompt_tokens=prompts[0], max_tokens=1))
    assert r.tokens_remote == 0 and r.tokens_computed == 8 * C
    assert e.metrics.decisions.labels("recompute")._value.get() == 1
    # the background probe measured the real (fast) store: the next hit is pulled
    deadline = time.monotonic() + 10
    while (e.cost.bandwidth or 0) < 1e5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (e.cost.bandwidth or 0) > 1e5
    r = e.complete(CompletionRequest(prompt_tokens=prompts[1], max_tokens=1))
    assert r.tokens_remote > 0
