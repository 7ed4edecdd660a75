"""redis-server paused, killed mid-load and restarted, with and without persistence.

A worker serves a stream of requests while its index goes away. It must keep answering
(recompute), within a bound, correctly; reconnect on its own when Redis is back; and after
an index loss (a restart without persistence) treat everything as a miss, never as an error
and never as a wrong answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

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
from tests.s3_servers import S3Server
from tests.servers import RedisServer, start_redis

pytestmark = pytest.mark.integration

# 82 letters + BOS = 83 tokens: 5 full chunks and a tail the 8 generated tokens stay inside,
# so each prompt is exactly 5 shareable chunks.
PROMPT_CHARS = 82
FULL = 5 * CHUNK
# 12 pages of 16 tokens and ~6 pages a request: a prompt two requests back is no longer in
# the worker's memory, so serving it again has to go to the index and the store.
CACHE_PAGES = 12


@dataclass
class Served:
    prompt: str
    at: float  # monotonic
    elapsed: float
    ok: bool
    tokens: list[int] = field(default_factory=list)
    remote: int = 0
    error: str = ""


class Driver(threading.Thread):
    """Sends requests back to back from a list of prompts, round robin, until stopped."""

    def __init__(self, worker: Worker, prompts: list[str]) -> None:
        super().__init__(name=f"driver-{worker.name}", daemon=True)
        self.worker = worker
        self.prompts = prompts
        self.served: list[Served] = []
        self._halt = threading.Event()

    def run(self) -> None:
        i = 0
        while not self._halt.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            i += 1
            t0 = time.monotonic()
            try:
                # the client's own timeout is twice the bound: a hang shows up as a slow
                # request (asserted below), not as a test stuck forever
                out = self.worker.complete(body(prompt), timeout=2 * REQUEST_BOUND_S)
                self.served.append(
                    Served(
                        prompt,
                        t0,
                        out["_elapsed"],
                        True,
                        answer(out),
                        out["kvcloud"]["tokens_remote"],
                    )
                )
            except Exception as exc:  # recorded and asserted on in the test
                self.served.append(
                    Served(prompt, t0, time.monotonic() - t0, False, error=repr(exc))
                )

    def stop(self) -> list[Served]:
        self._halt.set()
        self.join(4 * REQUEST_BOUND_S)
        assert not self.is_alive(), "a request never returned"
        return self.served


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[[bool], RedisServer]]:
    """A redis-server this test may kill (the session-wide one stays untouched)."""
    started: list[RedisServer] = []

    def start(persistence: bool) -> RedisServer:
        server = start_redis(tmp_path / "redis", persistence=persistence)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _dbsize(server: RedisServer) -> int:
    client = redis_py.Redis(host=server.host, port=server.port, socket_timeout=5)
    try:
        return int(client.dbsize())
    finally:
        client.close()


def _check_all(served: list[Served], reference: Reference) -> dict[str, Any]:
    failed = [s for s in served if not s.ok]
    assert not failed, f"requests failed: {[s.error for s in failed][:3]}"
    slowest = max((s.elapsed for s in served), default=0.0)
    assert slowest < REQUEST_BOUND_S, f"a request took {slowest:.1f}s"
    wrong = [s.prompt[:12] for s in served if s.tokens != reference.tokens(s.prompt)]
    assert not wrong, f"answers differ from the reference for {wrong}"
    return {"requests": len(served), "max_latency_s": round(slowest, 2), "wrong_answers": 0}


@pytest.mark.parametrize("persistence", [False, True], ids=["no-persistence", "aof"])
def test_redis_paused_killed_and_restarted_mid_load(
    persistence: bool,
    own_redis: Callable[[bool], RedisServer],
    s3_server: S3Server,
    spawn: Callable[..., Worker],
    reference: Reference,
    reliability: Observation,
) -> None:
    mode = "with AOF persistence" if persistence else "without persistence"
    reliability.scenario = f"redis-server paused, then killed mid-load and restarted {mode}"
    reliability.must = (
        "every request answered within 15 s with the reference's token ids; the worker "
        "reconnects on its own; "
        + (
            "entries written before the kill are hits again after the restart"
            if persistence
            else "after the index loss every old prefix is a miss (recomputed), never an error"
        )
    )
    server = own_redis(persistence)
    w = spawn(
        "w",
        s3_url(s3_server.endpoint),
        server.url,
        cache_pages=CACHE_PAGES,
        write_policy="write-through",
    )
    old = [text(PROMPT_CHARS, 100 + i) for i in range(6)]
    new = [text(PROMPT_CHARS, 200 + i) for i in range(4)]
    # 3 × 5 pages ≥ CACHE_PAGES: after the fillers nothing else is left in memory
    fillers = [text(PROMPT_CHARS, 300 + i) for i in range(3)]
    for p in old + new + fillers:
        reference.tokens(p)

    # 1. healthy: the old prompts are stored, and served back from the store
    for p in old:
        assert answer(w.complete(body(p))) == reference.tokens(p)
    assert w.drain(), "uploads did not finish"
    entries_before = _dbsize(server)
    baseline = w.complete(body(old[0]))  # evicted from memory by the later prompts
    assert baseline["kvcloud"]["tokens_remote"] == FULL, baseline["kvcloud"]

    # 2. under load: pause (a hung index), resume, then SIGKILL (a crashed one). old[:4]
    # stay out of it: none of their pages can sit in the upload queue across the restart.
    driver = Driver(w, old[4:] + new)
    driver.start()
    time.sleep(1.0)
    server.pause()
    time.sleep(2.0)
    server.resume()
    time.sleep(0.5)
    t_kill = time.monotonic()
    server.kill()
    time.sleep(3.0)
    served = driver.stop()
    during_outage = [s for s in served if s.at >= t_kill]
    assert len(during_outage) >= 2, "the worker stopped serving while the index was down"
    load = _check_all(served, reference)

    # fill the worker's memory with prompts the index never saw, so the old ones are gone
    for p in fillers:
        assert answer(w.complete(body(p))) == reference.tokens(p)

    # 3. restart on the same port: the worker must find it again by itself
    server.start()
    entries_after_restart = _dbsize(server)
    after: list[dict[str, Any]] = []
    for p in old[:4]:
        out = w.complete(body(p))
        assert out["_elapsed"] < REQUEST_BOUND_S
        assert answer(out) == reference.tokens(p)
        after.append(out["kvcloud"])
    remote_after = [k["tokens_remote"] for k in after]
    if persistence:
        assert entries_after_restart >= entries_before, (entries_before, entries_after_restart)
        assert remote_after == [FULL] * 4, remote_after  # the AOF brought the entries back
    else:
        # index lost: all misses, all recomputed. (The key count is only logged: uploads
        # queued during the outage may register right after the restart.)
        assert remote_after == [0] * 4, remote_after
    # reconnected: what is uploaded now is registered and served from the store again
    assert w.drain(), "uploads did not finish after the restart"
    for p in fillers:
        w.complete(body(p))
    again = w.complete(body(old[0]))
    assert answer(again) == reference.tokens(old[0])
    assert again["kvcloud"]["tokens_remote"] == FULL, again["kvcloud"]
    m = w.metrics()
    reliability.note(
        **load,
        requests_during_outage=len(during_outage),
        max_latency_during_outage_s=round(max(s.elapsed for s in during_outage), 2),
        redis_keys_before_kill=entries_before,
        redis_keys_after_restart=entries_after_restart,
        tokens_remote_after_restart=remote_after,
        tokens_remote_after_reconnect=again["kvcloud"]["tokens_remote"],
        uploads_failed=m.get('kvcloud_worker_uploads_total{result="failed"}', 0.0),
        uploads_ok=m.get('kvcloud_worker_uploads_total{result="ok"}', 0.0),
    )
