"""The uploader times each chunk from the moment it is handed over to its entry visible in
the index (the save lag, exported as ``vllm:kvcloud_save_lag_seconds``): a next turn sent
sooner than that finds the chunk missing. Real file store and SQLite index."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from kvcloud.integrations.vllm.uploader import Uploader
from tests.unit.test_vllm_uploader import setup


def test_each_chunk_is_timed_until_its_entry_is_visible(tmp_path: Path) -> None:
    kvc, counts, (ns, tokens, _kv, chunks) = setup(tmp_path)
    gate = threading.Event()
    put = kvc.store.put

    def held_put(key: str, data: object) -> bool:
        gate.wait(30)  # the store answers only once the test lets it
        return put(key, data)

    kvc.store.put = held_put  # type: ignore[method-assign]
    lags: list[float] = []
    uploads: list[float] = []
    seen_at_observe: list[int] = []

    def observe(name: str, seconds: float) -> None:
        if name == "upload_seconds":
            uploads.append(seconds)
            return
        assert name == "save_lag_seconds"
        # the entry is visible when the lag is taken, never before
        seen_at_observe.append(kvc.lookup(ns, tokens).tokens)
        lags.append(seconds)

    up = Uploader(kvc, ns, 8, counts.update, observe=observe)
    for fp, parent, arr in chunks:
        assert up.offer("default", fp, parent, arr)
    hold = 0.3
    time.sleep(hold)
    assert up.depth() == 4  # the upload_queue_depth gauge: queued or in the held push
    gate.set()
    up.close()
    assert up.depth() == 0
    assert len(lags) == 4
    assert min(lags) >= hold  # the store held every put: each lag covers that wait
    # the upload time runs from the chunk taken off the queue: within the lag, and it
    # covers the held put too (the uploader took the first chunk at once)
    assert len(uploads) == 4
    assert all(u <= lag for u, lag in zip(uploads, lags, strict=True))
    assert max(uploads) >= hold * 0.9
    assert seen_at_observe and min(seen_at_observe) == len(tokens)
    kvc.close()


def test_a_failed_push_is_not_timed(tmp_path: Path) -> None:
    kvc, _counts, (ns, _tokens, _kv, chunks) = setup(tmp_path)

    def broken(key: str, data: object) -> bool:
        raise OSError("disk gone")

    kvc.store.put = broken  # type: ignore[method-assign]
    lags: list[tuple[str, float]] = []
    up = Uploader(kvc, ns, 8, Counter().update, observe=lambda *seen: lags.append(seen))
    for fp, parent, arr in chunks:
        up.offer("default", fp, parent, arr)
    up.close()
    assert lags == []
    assert up._offered_at == {}  # nothing left behind
    kvc.close()
