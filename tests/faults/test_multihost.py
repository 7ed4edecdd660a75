"""Multi-host: Redis and the S3 server on one network namespace, workers on two others.

A session moves between hosts (flushed on A, continued on B with the same token ids as a
reference). Then A's link to the store is cut while it uploads: A keeps answering
(recompute), a flush it cannot complete is refused (503), never acknowledged, and every
session flushed and acknowledged before the cut continues on B. After the link heals, A
flushes again and no index entry names a missing or bad object.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.conftest import (
    REQUEST_BOUND_S,
    Reference,
    Worker,
    answer,
    assert_verified,
    body,
    s3_url,
    text,
)
from tests.faults.netns import Lab, NetnsUnavailable
from tests.faults.report import Observation
from tests.servers import MotoServer, RedisServer, start_moto, start_redis

pytestmark = pytest.mark.integration

TURN_MAX = 8
SCENARIO = (
    "multi-host: Redis + S3 server, worker A and worker B in three network namespaces; "
    "a session moves A → B; A's store link cut mid-upload"
)
MUST = (
    "the moved session continues on B with the reference's token ids; while cut, A "
    "answers within 15 s and refuses (503) a flush it cannot complete; every session "
    "flushed and acknowledged before the cut continues on B; after healing, A flushes "
    "again and verify finds no entry without a valid object"
)


@pytest.fixture
def lab(tmp_path: Path, reliability: Observation) -> Iterator[tuple[Lab, RedisServer, MotoServer]]:
    """Three hosts; servers started on 'srv'. Everything is torn down, even on failure."""
    # named before anything can skip, so that a skip reaches the reliability log too
    reliability.scenario, reliability.must = SCENARIO, MUST
    if shutil.which("ip") is None:
        pytest.fail("the multi-host test needs iproute2: apt-get install -y iproute2")
    lab = Lab()
    servers: list[RedisServer | MotoServer] = []
    try:
        try:
            lab.up()
        except NetnsUnavailable as exc:
            pytest.skip(f"this sandbox forbids network namespaces: {exc}")
        srv = lab.add_host("srv")
        lab.add_host("a", mgmt=True)
        lab.add_host("b", mgmt=True)
        redis = start_redis(tmp_path / "redis", host=srv.addr, netns=srv.name)
        servers.append(redis)
        moto = start_moto(tmp_path / "moto", host=srv.addr, netns=srv.name)
        servers.append(moto)
        yield lab, redis, moto
    finally:
        for s in servers:
            s.stop()
        lab.close()


def _turns(seed: int, n: int) -> list[str]:
    return [text(40 + 7 * i, seed + i) for i in range(n)]


def _reference_session(reference: Reference, turns: list[str]) -> list[list[int]]:
    w = reference.worker
    sid = w.post("/v1/sessions").json()["id"]
    return [answer(w.complete(body(t, TURN_MAX, session_id=sid))) for t in turns]


def test_session_moves_between_hosts_and_a_cut_link_loses_nothing_acknowledged(
    lab: tuple[Lab, RedisServer, MotoServer],
    spawn: Callable[..., Worker],
    reference: Reference,
    reliability: Observation,
) -> None:
    net, redis, moto = lab
    store = s3_url(moto.endpoint)
    a_host, b_host = net.hosts["a"], net.hosts["b"]

    def worker(name: str, host: Any) -> Worker:
        return spawn(
            name,
            store,
            redis.url,
            write_policy="write-through",
            netns=host.name,
            host="0.0.0.0",
            connect=host.mgmt,
        )

    a, b = worker("a", a_host), worker("b", b_host)
    s1, s2, s3 = _turns(900, 3), _turns(910, 2), _turns(920, 2)
    ref1, ref2, ref3 = (_reference_session(reference, t) for t in (s1, s2, s3))

    # 1. a session moves between hosts
    sid1 = a.post("/v1/sessions").json()["id"]
    got1 = [answer(a.complete(body(t, TURN_MAX, session_id=sid1))) for t in s1[:2]]
    flush1 = a.post(f"/v1/sessions/{sid1}/flush").json()
    assert flush1["stored"] is True
    out = b.complete(body(s1[2], TURN_MAX, session_id=sid1))
    got1.append(answer(out))
    assert got1 == ref1
    assert out["kvcloud"]["tokens_remote"] == flush1["kv_tokens"]

    # 2. a second session flushed (acknowledged) on A just before the cut
    sid2 = a.post("/v1/sessions").json()["id"]
    got2 = [answer(a.complete(body(s2[0], TURN_MAX, session_id=sid2)))]
    flush2 = a.post(f"/v1/sessions/{sid2}/flush").json()
    assert flush2["stored"] is True

    # 3. A uploads heavily; its store link is cut in the middle of it
    halt = threading.Event()
    load: list[float] = []
    load_errors: list[str] = []

    def feed() -> None:
        seed = 5000
        while not halt.is_set():
            t0 = time.monotonic()
            try:
                a.complete(body(text(8 * 16 - 1, seed), 2), timeout=2 * REQUEST_BOUND_S)
                load.append(time.monotonic() - t0)
            except (httpx.HTTPError, AssertionError) as exc:
                load_errors.append(repr(exc))
            seed += 1

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    deadline = time.monotonic() + 10
    queued = 0.0
    while time.monotonic() < deadline:  # cut once uploads are pending
        queued = a.metrics().get("kvcloud_worker_upload_queue_depth", 0.0)
        if queued > 0:
            break
        time.sleep(0.02)
    net.cut("a")
    t_cut = time.monotonic()
    try:
        time.sleep(2.0)
        halt.set()
        feeder.join(4 * REQUEST_BOUND_S)
        assert not feeder.is_alive()
        # A still answers, by recomputing
        probe = text(82, 930)
        out = a.complete(body(probe), timeout=4 * REQUEST_BOUND_S)
        assert out["_elapsed"] < REQUEST_BOUND_S
        assert answer(out) == reference.tokens(probe)
        # a flush that cannot reach the store is refused, not acknowledged
        sid3 = a.post("/v1/sessions").json()["id"]
        got3 = [answer(a.complete(body(s3[0], TURN_MAX, session_id=sid3)))]
        t0 = time.monotonic()
        refused = a.post(f"/v1/sessions/{sid3}/flush", timeout=4 * REQUEST_BOUND_S)
        flush_cut_s = time.monotonic() - t0
        assert refused.status_code == 503, refused.text
        # what was acknowledged before the cut continues on B
        out = b.complete(body(s2[1], TURN_MAX, session_id=sid2))
        got2.append(answer(out))
        assert got2 == ref2
        assert out["kvcloud"]["tokens_remote"] == flush2["kv_tokens"]
    finally:
        net.heal("a")
    cut_s = time.monotonic() - t_cut
    assert not load_errors, load_errors[:3]
    assert max(load) < REQUEST_BOUND_S

    # 4. healed: A reaches the store again by itself
    def flushed() -> bool:
        r = a.post(f"/v1/sessions/{sid3}/flush", timeout=4 * REQUEST_BOUND_S)
        return r.status_code == 200 and r.json()["stored"] is True

    t0 = time.monotonic()
    while not flushed():
        assert time.monotonic() - t0 < 30, "A did not reconnect after the link healed"
        time.sleep(0.5)
    reconnect_s = time.monotonic() - t0
    out = b.complete(body(s3[1], TURN_MAX, session_id=sid3))
    got3.append(answer(out))
    assert got3 == ref3
    assert a.drain(timeout=60)
    summary = assert_verified(store, redis.url, reliability)
    reliability.note(
        hosts={role: h.addr for role, h in net.hosts.items()},
        moved_session_tokens_restored_on_b=flush1["kv_tokens"],
        upload_queue_at_cut=queued,
        requests_on_a_around_cut=len(load),
        max_latency_around_cut_s=round(max(load), 2),
        flush_during_cut_status=refused.status_code,
        flush_during_cut_s=round(flush_cut_s, 2),
        acknowledged_session_restored_on_b=flush2["kv_tokens"],
        link_cut_s=round(cut_s, 1),
        reconnect_after_heal_s=round(reconnect_s, 2),
        index_entries=summary["entries"],
        wrong_answers=0,
    )
