"""The vLLM connector's uploader: object before entry, bounded queue that drops and counts,
failures counted and survived. Runs against the embedded store and index (real files)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np

from kvcloud import KVCloud, StoreUnavailableError
from kvcloud.integrations.vllm.uploader import Uploader
from kvcloud.namespace import chunk_fingerprints
from tests.helpers import make_kv, make_ns, make_tokens, same_bits


def setup(tmp_path: Path) -> tuple[KVCloud, Counter, list]:
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    counts: Counter[str] = Counter()
    ns = make_ns()
    tokens = make_tokens(4 * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    fps = chunk_fingerprints(ns, tokens, kvc.tenant_key("default"))
    c = ns.chunk_tokens
    chunks = [
        (fps[i], fps[i - 1] if i else ns.digest, kv[:, :, i * c : (i + 1) * c]) for i in range(4)
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
