"""A stop right after the last answers (a rolling update): the chunks still queued for
upload reach the store before the worker exits (issue 40, defect 8).

vLLM's API server gives its engine ``--shutdown-timeout`` seconds after a SIGTERM before it
kills the engine and its workers; with vLLM's default, 0, it kills them at once and nothing
still queued can survive (docs/VLLM.md, "Stopping"). Within that window the engine core
gives a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) to exit; the connector drains its
queue within that, less a margin (4 s here), then logs and counts what it could not push.

The answer's chunks must still be queued when the SIGTERM goes, however fast this machine
pushes: the test holds the sqlite index's write lock from before the request until the
worker says it is draining at stop (at most ``HOLD`` seconds), so every push waits for its
entry until then (the index's busy timeout is 10 s). Its own store, so it counts only its
own entries.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scripts.fleet.vllm_fleet import VLLMServer, cached_tokens, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, start_all
from tests.vllm.helpers import assert_same_answer, wait_stored

# vLLM servers take ~40 s each to start, more when several start together on 2 cores
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
# what docs/VLLM.md has a rolling update set: the engine stops well within it
SHUTDOWN_TIMEOUT = 15
DRAINING = "kvcloud uploader: stopping with"
HOLD = 5.0  # seconds after the SIGTERM the index stays locked at most


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("stop"), "vllm-stop-secret")


@contextmanager
def index_write_lock(store: dict[str, str]) -> Iterator[sqlite3.Connection]:
    """The sqlite index's write lock (readers, such as the scheduler's lookups, go on):
    every push waits on its entry while this is held."""
    conn = sqlite3.connect(store["KVCLOUD_INDEX"].removeprefix("sqlite://"), timeout=30)
    conn.isolation_level = None
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def wait_for_log(server: VLLMServer, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in server.log_text():
            return True
        if server.proc is not None and server.proc.poll() is not None:
            return text in server.log_text()
        time.sleep(0.05)
    return False


def test_chunks_queued_at_sigterm_reach_the_store(
    store: dict[str, str], vllm_logs: Path, request: pytest.FixtureRequest
) -> None:
    prompt = prompt_tokens(1800, seed=81)
    whole = len(prompt) // CHUNK * CHUNK  # 7 full chunks: 1,792 tokens
    a = VLLMServer(
        "stop-A",
        vllm_logs / "stop-A.log",
        transfer=kvcloud_transfer_config(),
        env=store,
        args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
    )
    # the replacement, a fresh vLLM on the same store, starts beside A (it stays idle, and
    # never held the prompt, until A has stopped)
    b = VLLMServer(
        "stop-B", vllm_logs / "stop-B.log", transfer=kvcloud_transfer_config(), env=store
    )
    a, b = start_all(a, b)
    try:
        with index_write_lock(store):
            first = a.complete(prompt, max_tokens=1)
            assert cached_tokens(first) == 0
            sent = a.sigterm()  # right after the answer: nothing waits for the store
            # the index comes back once the worker says it drains, or after HOLD seconds
            # (well inside the 9 s vLLM lets a worker live: a connector that drains
            # without saying so still has the time)
            announced = wait_for_log(a, DRAINING, timeout=HOLD)
        code = a.wait_exit(timeout=2 * SHUTDOWN_TIMEOUT)
        took = time.monotonic() - sent
    except BaseException:
        b.stop()
        raise
    finally:
        a.stop()
    log = a.log_text()
    print(f"stop-A exited {code} {took:.1f} s after SIGTERM")
    # the replacement restores every full chunk
    try:
        assert code == 0 and took < SHUTDOWN_TIMEOUT + 5, a.log_tail(60)
        assert wait_stored(store, prompt, timeout=0) == whole // CHUNK, a.log_tail(60)
        reference: VLLMServer = request.getfixturevalue("reference")
        got = b.complete(prompt, max_tokens=16)
        assert cached_tokens(got) >= whole
        assert b.metrics().get("loaded_tokens", 0) >= whole
        assert_same_answer(got, reference.complete(prompt, max_tokens=16), "restored after a stop")
    finally:
        b.stop()

    # and the stop said what it did: chunks were queued, all stored, none given up
    assert announced, f"no drain at stop in the log:\n{a.log_tail(60)}"
    assert "stored the chunks queued at stop" in log, a.log_tail(60)
    assert "chunks not stored" not in log, a.log_tail(60)
