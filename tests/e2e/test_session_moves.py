"""Worker processes over HTTP, against a real redis-server and a moto_server process."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from tests.e2e.conftest import CHUNK

GEN = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, "ignore_eos": True}


def _text(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(chr(c) for c in rng.integers(97, 123, n))


TURNS = [_text(70, 1), _text(45, 2), _text(60, 3), _text(33, 4)]


def _run(worker, sid: str, turns: list[str]) -> list[list[int]]:
    return [
        worker.complete({"prompt": t, "session_id": sid, **GEN})["choices"][0]["token_ids"]
        for t in turns
    ]


def _reference(spawn, turns: list[str]) -> list[list[int]]:
    r = spawn("ref")
    sid = r.post("/v1/sessions").json()["id"]
    out = _run(r, sid, turns)
    r.stop()
    return out


def test_session_flushed_on_a_continues_on_b_bit_identical(spawn, servers_urls) -> None:
    store, index = servers_urls
    ref = _reference(spawn, TURNS)
    a = spawn("a", store, index)
    sid = a.post("/v1/sessions").json()["id"]
    got = _run(a, sid, TURNS[:2])
    flush = a.post(f"/v1/sessions/{sid}/flush").json()
    # the uploader may have stored some full chunks since the turns (session write-through)
    assert flush["stored"] is True and flush["chunks_pushed"] <= flush["kv_tokens"] // CHUNK
    b = spawn("b", store, index)
    out = b.complete({"prompt": TURNS[2], "session_id": sid, **GEN})
    k = out["kvcloud"]
    assert k["tokens_remote"] == flush["kv_tokens"]  # the whole flushed history
    assert k["tokens_local"] == 0
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == flush["kv_tokens"]
    got.append(out["choices"][0]["token_ids"])
    got += _run(b, sid, TURNS[3:])
    assert got == ref


def test_sigterm_flushes_and_a_restarted_worker_resumes(spawn, servers_urls) -> None:
    store, index = servers_urls
    ref = _reference(spawn, TURNS)
    a = spawn("a", store, index)
    sid = a.post("/v1/sessions").json()["id"]
    got = _run(a, sid, TURNS[:3])
    # uvicorn re-raises SIGTERM after the graceful shutdown (which flushed)
    assert a.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    a.start()  # a new process on the same port and store
    info = a.client.get(f"/v1/sessions/{sid}").json()
    assert info["stored"] is True and info["resident"] is False
    out = a.complete({"prompt": TURNS[3], "session_id": sid, **GEN})
    assert out["kvcloud"]["tokens_remote"] > 0
    assert [*got, out["choices"][0]["token_ids"]] == ref


@pytest.mark.parametrize("write_through", [True, False])
def test_sigkill_loses_only_what_was_never_written(
    spawn, servers_urls, write_through: bool
) -> None:
    """With session write-through (the default) every answered turn is in the index, so a
    SIGKILL loses none of them; without it, the turns since the last flush are lost."""
    store, index = servers_urls
    # what the session looked like when last written, then the new turn
    kept = TURNS[:2] if write_through else TURNS[:1]
    ref = _reference(spawn, [*kept, TURNS[2]])
    env = {"KVCLOUD_SESSION_WRITE_THROUGH": "1" if write_through else "0"}
    a = spawn("a", store, index, env=env)
    sid = a.post("/v1/sessions").json()["id"]
    _run(a, sid, TURNS[:1])
    a.post(f"/v1/sessions/{sid}/flush")
    _run(a, sid, TURNS[1:2])  # answered, never flushed
    a.stop(signal.SIGKILL)
    a.start()
    out = a.complete({"prompt": TURNS[2], "session_id": sid, **GEN})
    assert out["choices"][0]["token_ids"] == ref[-1]
    # and a plain request is answered as by any worker
    plain = a.complete({"prompt": TURNS[3], **GEN})
    r = spawn("r2")
    assert (
        plain["choices"][0]["token_ids"]
        == r.complete({"prompt": TURNS[3], **GEN})["choices"][0]["token_ids"]
    )


def test_evictions_on_a_serve_a_new_session_on_b(spawn, servers_urls) -> None:
    store, index = servers_urls
    a = spawn("a", store, index, cache_pages=6)
    shared = _text(5 * CHUNK, 9)
    sid = a.post("/v1/sessions").json()["id"]
    a.complete({"prompt": shared, "session_id": sid, **GEN})
    # a long conversation pushes the shared prefix's pages out of A's small pool
    for i in range(4):
        a.complete({"prompt": _text(3 * CHUNK, 20 + i), **GEN})
    time.sleep(0.5)
    metrics = a.client.get("/metrics").text
    assert "kvcloud_worker_pages_evicted_total" in metrics
    b = spawn("b", store, index)
    sid_b = b.post("/v1/sessions").json()["id"]
    out = b.complete({"prompt": shared, "session_id": sid_b, **GEN})
    assert out["kvcloud"]["tokens_remote"] > 0


def test_worker_with_unreachable_store_still_answers(spawn, tmp_path) -> None:
    from tests.servers import free_port

    dead = f"s3://b/p?endpoint_url=http://127.0.0.1:{free_port()}&max_attempts=1"
    w = spawn(
        "dead",
        dead,
        f"redis://127.0.0.1:{free_port()}/0",
        extra=["--write-policy", "write-through"],
        env={"KVCLOUD_REMOTE_TIMEOUT": "0.5"},
    )
    ref = spawn("ref")
    t0 = time.monotonic()
    out = w.complete({"prompt": TURNS[0] * 2, **GEN})
    assert time.monotonic() - t0 < 30
    assert (
        out["choices"][0]["token_ids"]
        == ref.complete({"prompt": TURNS[0] * 2, **GEN})["choices"][0]["token_ids"]
    )
    assert w.client.get("/healthz").status_code == 200
