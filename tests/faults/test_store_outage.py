"""The S3 server paused (SIGSTOP), resumed, killed and restarted empty, under a worker.

While the store hangs, pulls must time out and fall back to recompute (answers still right,
within the bound), and the upload queue must stay bounded (the surplus dropped and counted,
never blocking a request). When the store is back, uploads resume: new objects appear and are
served back. When it comes back empty (moto keeps everything in memory: a lost volume),
entries that name vanished objects are misses, detected and counted on pull.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcloud.stores import open_store
from tests.faults.conftest import (
    CHUNK,
    REQUEST_BOUND_S,
    Reference,
    Worker,
    answer,
    body,
    s3_url,
    text,
)
from tests.faults.report import Observation
from tests.servers import MotoServer, start_moto

pytestmark = pytest.mark.integration

PROMPT_CHARS = 82  # + BOS: 5 full chunks, generation stays in the tail
FULL = 5 * CHUNK
QUEUE = 5  # pages: one prompt's 5 chunks fit; behind a stalled upload the next prompt overflows it


@pytest.fixture
def own_moto(tmp_path: Path) -> Iterator[MotoServer]:
    server = start_moto(tmp_path / "moto")
    yield server
    server.stop()


def _objects(url: str) -> int:
    with open_store(url) as store:
        return sum(1 for _ in store.list())


def _uploads(m: dict[str, float], result: str) -> float:
    return m.get(f'kvcloud_worker_uploads_total{{result="{result}"}}', 0.0)


def test_s3_paused_killed_and_restarted(
    own_moto: MotoServer,
    redis_url: str,
    spawn: Callable[..., Worker],
    reference: Reference,
    reliability: Observation,
) -> None:
    reliability.scenario = "S3 server paused (SIGSTOP), resumed, killed, restarted empty"
    reliability.must = (
        "requests answered correctly within 15 s; pulls time out and fall back (counted); "
        f"the upload queue never exceeds its bound ({QUEUE}) and the surplus is dropped and "
        "counted; uploads resume when the server returns (objects appear and are served back)"
    )
    store = s3_url(own_moto.endpoint)
    w = spawn(
        "w",
        store,
        redis_url,
        cache_pages=12,
        write_policy="write-through",
        upload_queue=QUEUE,
    )
    old = [text(PROMPT_CHARS, 400 + i) for i in range(5)]
    new = [text(PROMPT_CHARS, 500 + i) for i in range(6)]
    # 3 × 5 pages ≥ the 12 in memory: after the fillers nothing else is left there
    fillers = [text(PROMPT_CHARS, 600 + i) for i in range(3)]
    for p in old + new + fillers:
        reference.tokens(p)
    latencies: list[float] = []
    depths: list[float] = []

    def serve(p: str) -> dict[str, Any]:
        out = w.complete(body(p), timeout=4 * REQUEST_BOUND_S)
        latencies.append(out["_elapsed"])
        assert out["_elapsed"] < REQUEST_BOUND_S, f"{out['_elapsed']:.1f}s"
        assert answer(out) == reference.tokens(p)
        depths.append(w.metrics().get("kvcloud_worker_upload_queue_depth", 0.0))
        assert depths[-1] <= QUEUE
        return out["kvcloud"]

    # 1. healthy; one upload at a time so that nothing is dropped yet
    for p in old:
        serve(p)
        assert w.drain()
    objects_healthy = _objects(store)
    assert serve(old[0])["tokens_remote"] == FULL
    m0 = w.metrics()

    # 2. paused: every store call hangs until its timeout
    own_moto.pause()
    paused_latencies: list[float] = []
    try:
        for p in [new[0], old[1], new[1], old[2], new[2]]:
            serve(p)
            paused_latencies.append(latencies[-1])
        m1 = w.metrics()
    finally:
        own_moto.resume()
    fallbacks = (
        m1["kvcloud_worker_remote_fallbacks_total"] - m0["kvcloud_worker_remote_fallbacks_total"]
    )
    dropped = _uploads(m1, "dropped") - _uploads(m0, "dropped")
    assert fallbacks >= 1, "no pull fell back while the store hung"
    assert dropped >= 1, "nothing was dropped although the queue overflowed"

    # 3. resumed: the queue drains and new uploads land
    assert w.drain(timeout=60), "uploads did not resume"
    serve(new[3])
    assert w.drain(timeout=60)
    objects_resumed = _objects(store)
    assert objects_resumed >= objects_healthy + 5
    for p in fillers:
        serve(p)
    assert serve(new[3])["tokens_remote"] == FULL  # uploaded after the pause, served back
    m2 = w.metrics()

    # 4. killed: refused connections, answered at once
    own_moto.kill()
    killed_latencies: list[float] = []
    for p in [new[4], old[3]]:
        serve(p)
        killed_latencies.append(latencies[-1])

    # 5. restarted empty on the same port (the bucket is recreated, as after a lost volume)
    own_moto.start()
    open_store(store).close()  # the store URL says create_bucket=true
    fb_before = w.metrics()["kvcloud_worker_remote_fallbacks_total"]
    k = serve(old[4])  # its entries name objects that are gone
    assert k["tokens_remote"] == 0
    assert w.metrics()["kvcloud_worker_remote_fallbacks_total"] > fb_before
    assert w.drain(timeout=60)
    serve(new[5])
    assert w.drain(timeout=60)
    objects_after_restart = _objects(store)
    assert objects_after_restart >= 5
    for p in fillers:
        serve(p)
    assert serve(new[5])["tokens_remote"] == FULL
    m3 = w.metrics()

    reliability.note(
        requests=len(latencies),
        max_latency_s=round(max(latencies), 2),
        max_latency_paused_s=round(max(paused_latencies), 2),
        max_latency_killed_s=round(max(killed_latencies), 2),
        upload_queue_bound=QUEUE,
        max_upload_queue_depth=max(depths),
        uploads_dropped_while_paused=dropped,
        remote_fallbacks_while_paused=fallbacks,
        objects_before_pause=objects_healthy,
        objects_after_resume=objects_resumed,
        objects_after_empty_restart=objects_after_restart,
        uploads_ok_total=_uploads(m3, "ok"),
        uploads_failed_total=_uploads(m3, "failed"),
        uploads_dropped_total=_uploads(m3, "dropped"),
        uploads_ok_after_resume=_uploads(m2, "ok") - _uploads(m1, "ok"),
    )
