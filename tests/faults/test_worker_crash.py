"""Workers SIGKILLed at 20 random points while they upload heavily (write-through).

Invariant 1 (object before entry) is what a crash tests: whatever instant the process dies
at, no index entry may name an object that is missing, short or corrupt. Leaked objects
(written, never registered) are allowed: gc reclaims them. Two workers crash side by side
(10 kills each, 20 in all): concurrent writers, and half the wall time on two cores.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.ceph import CephRGW
from tests.faults.conftest import Worker, assert_verified, body, s3_url, text
from tests.faults.report import Observation
from tests.s3_servers import WITHOUT_CONDITIONAL_WRITES, S3Server, server_name

pytestmark = pytest.mark.integration

KILLS = 20  # on Ceph; half as many on each server without conditional writes
LOOPS = 2  # workers crashing side by side, KILLS // LOOPS kills each
SEED = 20_240_607  # the kill points are random but reproducible
PROMPT_CHARS = 8 * 16 - 1  # + BOS: 8 full chunks per prompt, 8 uploads each


class Feeder(threading.Thread):
    """Feeds a worker new prompts (every chunk a new upload) until the worker dies."""

    def __init__(self, worker: Worker, first_seed: int, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.worker = worker
        self.seed = first_seed
        self.gaps = [rng.uniform(0.0, 0.03) for _ in range(1000)]
        self.completed = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.worker.complete(body(text(PROMPT_CHARS, self.seed), max_tokens=2), timeout=30)
            except (httpx.HTTPError, AssertionError):
                return  # killed under us
            self.seed += 1
            # short gaps: the uploader runs flat out between requests and at a 5 % duty
            # cycle during them, so both regimes are crashed into
            time.sleep(self.gaps[self.completed % len(self.gaps)])
            self.completed += 1


def crash_loop(
    w: Worker, rng: random.Random, kills: int, first_seed: int, out: list[dict[str, Any]]
) -> None:
    seed = first_seed
    for _ in range(kills):
        w.start()
        feeder = Feeder(w, seed, rng)
        feeder.start()
        delay = rng.uniform(0.15, 1.0)
        time.sleep(delay)
        # from that random point, the first moment the uploader holds queued chunks (on a
        # fast server it drains between requests): a kill there is a kill between objects
        # and their entries, what this test is about; after 0.5 s it kills whatever it finds
        until = time.monotonic() + 0.5
        while True:
            try:
                m = w.metrics()
            except httpx.HTTPError:
                m = {}
            if m.get("kvcloud_worker_upload_queue_depth", 0) > 0 or time.monotonic() > until:
                break
            time.sleep(0.01)
        w.kill()
        feeder.halt.set()
        feeder.join(30)
        assert not feeder.is_alive()
        seed = feeder.seed + 1
        out.append(
            {
                "worker": w.name,
                "after_s": round(delay, 3),
                "requests": feeder.completed,
                "queue_depth": m.get("kvcloud_worker_upload_queue_depth", -1.0),
            }
        )


# a crash between an object and its entry, on a server that honours conditional writes and
# on two that do not
@pytest.mark.parametrize("s3_server", ["ceph", *WITHOUT_CONDITIONAL_WRITES], indirect=True)
def test_sigkill_at_random_points_leaves_no_dangling_entry(
    s3_server: S3Server,
    redis_url: str,
    spawn: Callable[..., Worker],
    reliability: Observation,
) -> None:
    kills_wanted = KILLS if isinstance(s3_server, CephRGW) else KILLS // 2
    reliability.scenario = (
        f"{LOOPS} workers SIGKILLed at {kills_wanted} random points in all during heavy uploading, "
        f"on {server_name(s3_server)}"
    )
    reliability.must = (
        "afterwards no index entry names a missing, short or corrupt object (orphan objects "
        "are allowed); checked object by object and with `kvcloud verify --deep`"
    )
    store = s3_url(s3_server.endpoint)
    kills: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        w = spawn(f"w{i}", store, redis_url, write_policy="write-through", start=False)
        try:
            crash_loop(w, random.Random(SEED + i), kills_wanted // LOOPS, 10_000 * (i + 1), kills)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(LOOPS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a crash loop hung"
    if errors:
        raise errors[0]
    summary = assert_verified(store, redis_url, reliability)
    busy = sum(1 for k in kills if k["queue_depth"] > 0)
    reliability.note(
        kills=len(kills),
        kills_with_uploads_queued=busy,
        prompts_sent=sum(k["requests"] for k in kills),
        kill_points_s=[k["after_s"] for k in kills],
    )
    assert len(kills) == kills_wanted
    assert summary["entries"] > 0, "nothing was ever registered: the test did not test"
    # the kills must land while uploads are pending, or this proves nothing
    assert busy >= kills_wanted // 2, kills
