"""A burst of new requests against a slow index never stalls the requests already decoding.

vLLM asks the connector about every waiting request in one ``schedule()`` pass; each new
request's first ask may wait up to ``lookup_wait_ms`` for its index lookup. The code before
issue 40 waited that long per request, so N new requests against a slow index held the pass
(and every running decode with it) N waits long; now the asks of one pass share one
``lookup_wait_ms``.

One vLLM with the connector on a real redis-server behind a proxy (scripts/fault_proxy.py)
that holds each request 300 ms in ``slow`` mode: a request streams while 48 new requests
arrive at once; the streaming request's largest gap between two tokens, against a slow
index, stays within 1.5× of the same burst against a healthy index.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.fault_proxy import FaultProxy
from scripts.vllm_fleet import VLLMServer, kvcloud_transfer_config
from tests.servers import RedisServer, start_redis
from tests.vllm.conftest import prompt_tokens, serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BURST = 48
# the wait a first ask may take; larger than the default 20 ms so the difference between a
# wait per request (48 × 100 ms) and one per scheduler pass is far above this machine's noise
WAIT_MS = 100


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, FaultProxy]]:
    redis = start_redis(tmp_path_factory.mktemp("burst-redis"))
    proxy = FaultProxy(redis.port, delay=0.3)
    yield redis, proxy
    proxy.close()
    redis.stop()


@pytest.fixture(scope="module")
def server(
    index: tuple[RedisServer, FaultProxy],
    tmp_path_factory: pytest.TempPathFactory,
    vllm_logs: Path,
) -> Iterator[VLLMServer]:
    _, proxy = index
    folder = tmp_path_factory.mktemp("burst-store")
    env = {
        "KVCLOUD_STORE": f"file://{folder}/objects",
        "KVCLOUD_INDEX": f"redis://127.0.0.1:{proxy.port}/0",
        "KVCLOUD_SECRET": "burst-secret",
    }
    cfg = kvcloud_transfer_config(
        lookup_wait_ms=WAIT_MS, lookup_timeout=30.0, breaker_failures=1000
    )
    s = VLLMServer("burst", vllm_logs / "burst.log", transfer=cfg, env=env)
    for got in serving(s):
        yield got["burst"]


def largest_gap_during_burst(server: VLLMServer, seed: int) -> float:
    """Stream one request; once it is decoding, send BURST new requests at once; the
    largest gap (seconds) between two of the stream's tokens while the burst is served."""
    body = {
        "model": "smollm2",
        "prompt": prompt_tokens(64, seed=seed),
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    burst_at: list[float] = []

    def burst() -> None:
        burst_at.append(time.monotonic())
        with cf.ThreadPoolExecutor(BURST) as pool:
            futures = [
                pool.submit(
                    httpx.post,
                    server.url + "/v1/completions",
                    json={
                        "model": "smollm2",
                        "prompt": prompt_tokens(160, seed=seed + 1 + i),
                        "max_tokens": 1,
                    },
                    timeout=600,
                )
                for i in range(BURST)
            ]
            for f in futures:
                f.result().raise_for_status()

    sender: cf.Future[None] | None = None
    with (
        cf.ThreadPoolExecutor(1) as outer,
        httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text") is None:
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 8 and sender is None:
                sender = outer.submit(burst)
        assert sender is not None
        sender.result()
    start = burst_at[0]
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b >= start]
    assert gaps, "the stream ended before the burst arrived"
    return max(gaps)


def test_a_burst_against_a_slow_index_does_not_stall_decoding(
    server: VLLMServer, index: tuple[RedisServer, FaultProxy]
) -> None:
    _, proxy = index
    proxy.set_mode("pass")
    largest_gap_during_burst(server, seed=50)  # warm-up: first requests pay one-off costs
    healthy = largest_gap_during_burst(server, seed=1000)
    proxy.set_mode("slow")
    try:
        before = server.metrics()
        slow = largest_gap_during_burst(server, seed=2000)
        deferrals = server.metrics().get("lookup_deferrals", 0.0) - before.get(
            "lookup_deferrals", 0.0
        )
    finally:
        proxy.set_mode("pass")
    print(
        f"largest inter-token gap during a burst of {BURST}: healthy index {healthy * 1e3:.0f} ms, "
        f"slow index (300 ms a reply) {slow * 1e3:.0f} ms ({slow / healthy:.2f}x); "
        f"{deferrals:.0f} lookup deferrals"
    )
    assert deferrals > 0, "the slow index deferred no request: the test did not test"
    assert slow <= 1.5 * healthy, f"{slow * 1e3:.0f} ms against {healthy * 1e3:.0f} ms"
