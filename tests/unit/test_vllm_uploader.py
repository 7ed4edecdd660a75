"""The vLLM connector's uploader: object before entry, bounded queue that drops and counts,
failures counted and survived. Runs against the embedded store and index (real files)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvcloud import KVCloud, StoreUnavailableError
from kvcloud.integrations.vllm.uploader import Uploader
from kvcloud.namespace import chunk_fingerprints
from tests.helpers import make_kv, make_ns, make_tokens, same_bits


def setup(tmp_path: Path, n: int = 4) -> tuple[KVCloud, Counter, list]:
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    counts: Counter[str] = Counter()
    ns = make_ns()
    tokens = make_tokens(n * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    fps = chunk_fingerprints(ns, tokens, kvc.tenant_key("default"))
    c = ns.chunk_tokens
    chunks = [
        (fps[i], fps[i - 1] if i else ns.digest, kv[:, :, i * c : (i + 1) * c]) for i in range(n)
    ]
    return kvc, counts, [ns, tokens, kv, chunks]


def test_offered_chunks_are_stored_and_pulled_back(tmp_path: Path) -> None:
    kvc, counts, (ns, tokens, kv, chunks) = setup(tmp_path)
    up = Uploader(kvc, ns, 8, counts.update)
    for fp, parent, arr in chunks:
        assert up.offer("default", fp, parent, arr)
    up.close()
    assert counts["chunks_queued"] == 4 and counts["chunks_pushed"] == 4
    m = kvc.lookup(ns, tokens)
    assert m.tokens == len(tokens)
    assert same_bits(kvc.pull(m), kv)
    # offered again: found in the index, nothing written
    up = Uploader(kvc, ns, 8, counts.update)
    for fp, parent, arr in chunks:
        up.offer("default", fp, parent, arr)
    up.close()
    assert counts["chunks_already_stored"] == 4 and counts["chunks_pushed"] == 4
    kvc.close()


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    kvc, counts, (ns, _, _, chunks) = setup(tmp_path)
    gate = threading.Event()
    put = kvc.store.put

    def slow_put(key: str, data: object) -> bool:
        gate.wait(30)
        return put(key, data)

    kvc.store.put = slow_put  # type: ignore[method-assign]
    up = Uploader(kvc, ns, 1, counts.update)
    accepted = [up.offer("default", fp, parent, arr) for fp, parent, arr in chunks * 3]
    # the first is taken by the uploader thread (stuck in put), one more fits the queue
    assert accepted.count(True) <= 3 and counts["upload_dropped"] >= 9
    assert counts["upload_dropped"] + counts["chunks_queued"] == 12
    gate.set()
    up.close()
    assert counts["chunks_pushed"] >= 1
    kvc.close()


def test_store_failures_are_counted_and_the_uploader_survives(tmp_path: Path) -> None:
    kvc, counts, (ns, tokens, _, chunks) = setup(tmp_path)
    put = kvc.store.put
    broken = {"on": True}

    def failing_put(key: str, data: object) -> bool:
        if broken["on"]:
            raise StoreUnavailableError("store down")
        return put(key, data)

    kvc.store.put = failing_put  # type: ignore[method-assign]
    up = Uploader(kvc, ns, 8, counts.update)
    for fp, parent, arr in chunks[:2]:
        up.offer("default", fp, parent, arr)
    # wait for the failed batch before the store comes back
    deadline = 0
    while counts["push_failures"] < 2 and deadline < 300:
        threading.Event().wait(0.01)
        deadline += 1
    assert counts["push_failures"] == 2
    assert kvc.lookup(ns, tokens).tokens == 0  # no entry names an object that is not there
    broken["on"] = False
    for fp, parent, arr in chunks:
        up.offer("default", fp, parent, arr)
    up.close()
    assert counts["chunks_pushed"] == 4
    assert kvc.lookup(ns, tokens).tokens == 4 * ns.chunk_tokens
    assert np.asarray(chunks[0][2]).shape[2] == ns.chunk_tokens
    kvc.close()


def test_the_uploader_and_the_threads_it_starts_run_below_the_forward_pass(
    tmp_path: Path,
) -> None:
    kvc, counts, (ns, tokens, _, chunks) = setup(tmp_path)
    me = threading.get_native_id()
    mine = os.getpriority(os.PRIO_PROCESS, me)
    target = min(19, mine + 7)  # (a suite run under nice already cannot go lower than 19)
    before = {t.native_id for t in threading.enumerate()}
    seen: dict[int, int] = {}
    put = kvc.store.put

    def watching_put(key: str, data: object) -> bool:
        # whichever thread writes an object: the uploader or a pool thread it started
        tid = threading.get_native_id()
        seen[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        return put(key, data)

    kvc.store.put = watching_put  # type: ignore[method-assign]
    up = Uploader(kvc, ns, 8, counts.update, nice=target)
    for fp, parent, arr in chunks:
        assert up.offer("default", fp, parent, arr)
    up.close()
    assert counts["chunks_pushed"] == 4 and kvc.lookup(ns, tokens).tokens == len(tokens)
    assert seen and all(n == target for n in seen.values()), seen
    assert me not in seen and not before & set(seen)
    # the caller (vLLM's forward thread) keeps its priority
    assert os.getpriority(os.PRIO_PROCESS, me) == mine
    kvc.close()


# -- stop: drain within a deadline (issue 40, defect 8) ---------------------------------------


def test_close_pushes_what_is_queued_on_a_slowish_store_within_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kvc, counts, (ns, tokens, _, chunks) = setup(tmp_path, n=8)
    put = kvc.store.put

    def slow_put(key: str, data: object) -> bool:
        time.sleep(0.1)
        return put(key, data)

    kvc.store.put = slow_put  # type: ignore[method-assign]
    up = Uploader(kvc, ns, 16, counts.update)
    for fp, parent, arr in chunks:
        assert up.offer("default", fp, parent, arr)
    caplog.set_level(logging.INFO, logger="vllm.kvcloud")
    started = time.monotonic()
    left = up.close(10.0)
    assert time.monotonic() - started < 5.0
    assert counts["chunks_pushed"] == 8 and "upload_dropped_at_stop" not in counts
    assert kvc.lookup(ns, tokens).tokens == len(tokens)
    assert "stopping with" in caplog.text and "stored the chunks queued at stop" in caplog.text
    assert left == 0
    kvc.close()


def test_close_gives_up_at_its_deadline_and_counts_and_logs_what_is_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that hangs: close returns at its deadline; the chunk being pushed and the
    seven queued behind it are counted, logged, and given back; the queued ones are never
    pushed afterwards."""
    kvc, counts, (ns, tokens, _, chunks) = setup(tmp_path, n=8)
    entered, gate = threading.Event(), threading.Event()
    put = kvc.store.put

    def hung_put(key: str, data: object) -> bool:
        entered.set()
        gate.wait(30)
        return put(key, data)

    kvc.store.put = hung_put  # type: ignore[method-assign]
    given_back: list[bytes] = []
    up = Uploader(kvc, ns, 16, counts.update)
    fp, parent, arr = chunks[0]
    assert up.offer("default", fp, parent, arr, done=lambda fp=fp: given_back.append(fp))
    assert entered.wait(10)  # the uploader is in the first push: the rest stay queued
    for fp, parent, arr in chunks[1:]:
        assert up.offer("default", fp, parent, arr, done=lambda fp=fp: given_back.append(fp))
    caplog.set_level(logging.INFO, logger="vllm.kvcloud")
    started = time.monotonic()
    left = up.close(0.3)
    assert time.monotonic() - started < 1.5
    assert counts["upload_dropped_at_stop"] == 8 and counts["chunks_pushed"] == 0
    assert "8 chunks not stored" in caplog.text and "--shutdown-timeout" in caplog.text
    assert sorted(given_back) == sorted(fp for fp, _, _ in chunks[1:])  # buffers back
    assert left == 8
    gate.set()  # the hung push ends after all; the given-up chunks are not pushed
    up._thread.join(10)
    assert not up._thread.is_alive()
    assert counts["chunks_pushed"] == 1
    assert kvc.lookup(ns, tokens).tokens == ns.chunk_tokens
    kvc.close()


def test_the_stop_budget_stays_inside_what_vllm_allows() -> None:
    from kvcloud.integrations.vllm.uploader import stop_budget, worker_stop_timeout

    # vLLM's defaults: the engine core waits 5 s for a worker, then signals it
    assert stop_budget(0, 0, 5) == 4.0
    assert stop_budget(0, 30, 5) == 4.0
    # --shutdown-timeout shorter than the worker's wait bounds it
    assert stop_budget(0, 3, 5) == 2.0
    assert stop_budget(0, 30, 20) == 16.0
    # the setting shortens it, never lengthens it past what vLLM allows
    assert stop_budget(1.5, 30, 5) == 1.5
    assert stop_budget(60, 30, 5) == 4.0
    assert stop_budget(0, 0, 1) == 0.0
    assert worker_stop_timeout({}) == 5.0
    assert worker_stop_timeout({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "20"}) == 20.0
