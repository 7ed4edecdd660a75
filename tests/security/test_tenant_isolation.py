"""Tenant isolation with real processes: worker processes with API keys, a redis-server and a
moto_server. Tenant B sending tenant A's exact prompt gets no hit, and Redis's MONITOR shows
that none of B's commands even names a key of A's."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from tests.e2e.conftest import CHUNK, WorkerProc

pytestmark = pytest.mark.integration

KEY_A = "sk-alpha-" + secrets.token_hex(16)
KEY_A2 = "sk-alpha2-" + secrets.token_hex(16)  # another key of tenant A
KEY_B = "sk-beta-" + secrets.token_hex(16)
KEYS = f"{KEY_A}=alpha,{KEY_A2}=alpha,{KEY_B}=beta"
PROMPT = "Tenant isolation: the same prompt, two customers, nothing shared at all. " * 2
N_CHUNKS = (len(PROMPT) + 1) // CHUNK  # full chunks of BOS + the prompt's bytes
GEN = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
# The cost model would be free to recompute a remote hit; off, a hit is always pulled, so
# tokens_remote == 0 can only mean "no hit".
WORKER_ENV = {"KVCLOUD_API_KEYS": KEYS, "KVCLOUD_COST_MODEL": "false"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(w: WorkerProc, key: str, **body: Any) -> dict[str, Any]:
    r = w.client.post("/v1/completions", json={**GEN, **body}, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()["kvcloud"]


def settle(w: WorkerProc, timeout: float = 20.0) -> None:
    """Wait until the worker's uploads are done, then past the index's deferred TTL renewals
    (50 ms after a lookup), so what Redis sees next is caused by what the test does next."""
    deadline = time.monotonic() + timeout
    while w.client.get("/healthz").json()["upload_queue"] > 0:
        assert time.monotonic() < deadline, "uploads did not finish"
        time.sleep(0.05)
    time.sleep(0.5)


def scan(r: redis.Redis, pattern: str) -> set[str]:
    return {k.decode() for k in r.scan_iter(match=pattern, count=1000)}


@contextmanager
def monitored(url: str) -> Iterator[list[str]]:
    """Every command Redis executes inside the block, as MONITOR prints it (arguments joined
    by spaces), Lua scripts' inner calls included."""
    seen: list[str] = []
    stop = f"monitor-stop-{uuid.uuid4().hex}"
    started = threading.Event()
    client = redis.Redis.from_url(url)
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            with client.monitor() as m:
                started.set()
                for cmd in m.listen():
                    if stop in cmd["command"]:
                        return
                    seen.append(cmd["command"])
        except BaseException as exc:  # surfaced below; a silent monitor would prove nothing
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert started.wait(10)
    client.echo("monitor-start")  # MONITOR is live once its OK came back; this is a marker
    try:
        yield seen
    finally:
        client.echo(stop)
        thread.join(10)
        client.close()
    assert not errors, errors
    assert not thread.is_alive(), "MONITOR never saw the stop marker"
    assert any("monitor-start" in c for c in seen), "MONITOR missed the start marker"


def entries(r: redis.Redis) -> set[bytes]:
    """Every index entry's field (its binary fingerprint). Entries live in buckets shared
    by every tenant of a namespace, so what is a tenant's own is the field, not the key."""
    return {f for k in r.scan_iter(match="kvc:h:*", count=1000) for f in r.hkeys(k)}


def monitor_repr(field: bytes) -> str:
    """A binary argument as MONITOR prints it (Redis's sdscatrepr) and redis-py passes it
    on (with \\" turned back into a quote)."""
    special = {ord("\\"): "\\\\", ord('"'): '"', 10: "\\n", 13: "\\r", 9: "\\t", 7: "\\a", 8: "\\b"}
    return "".join(special.get(b, chr(b) if 32 <= b < 127 else f"\\x{b:02x}") for b in field)


def touched_fields(commands: list[str], fields: set[bytes]) -> set[bytes]:
    text = "\n".join(commands)
    return {f for f in fields if monitor_repr(f) in text}


def touched(commands: list[str], keys: set[str]) -> set[str]:
    """Which of ``keys`` the commands name, as a whole argument or inside one (a script's
    arguments, a packed value)."""
    words = {w for c in commands for w in c.split()}
    text = "\n".join(commands)
    return {k for k in keys if k in words or k in text}


def test_tenant_b_never_hits_or_touches_tenant_a(
    spawn: Callable[..., WorkerProc], servers_urls: tuple[str, str]
) -> None:
    store, index = servers_urls
    r = redis.Redis.from_url(index)
    extra = ["--write-policy", "write-through"]
    w = spawn("iso", store, index, extra=extra, env=WORKER_ENV)

    # -- tenant A: a prompt of several chunks, written through, and a flushed session
    before = scan(r, "kvc:*")
    before_entries = entries(r)
    a = complete(w, KEY_A, prompt=PROMPT)
    assert a["tokens_local"] == 0 and a["tokens_remote"] == 0
    sid = w.client.post("/v1/sessions", headers=bearer(KEY_A)).json()["id"]
    complete(w, KEY_A, prompt="a private turn", session_id=sid)
    assert w.client.post(f"/v1/sessions/{sid}/flush", headers=bearer(KEY_A)).status_code == 200
    settle(w)
    a_entries = entries(r) - before_entries
    a_sessions = scan(r, "kvc:s:*") - before
    assert len(a_entries) >= N_CHUNKS >= 4
    assert len(a_sessions) == 1

    # -- tenant B: A's exact prompt, A's session id, and attempts to pass for A
    with monitored(index) as commands:
        b = complete(w, KEY_B, prompt=PROMPT)
        b2 = complete(w, KEY_B, prompt=PROMPT, tenant="alpha", tenant_id="alpha")
        for resp in (
            w.client.get(f"/v1/sessions/{sid}", headers=bearer(KEY_B)),
            w.client.post(f"/v1/sessions/{sid}/flush", headers=bearer(KEY_B)),
            w.client.post(
                "/v1/completions",
                json={**GEN, "prompt": "x", "session_id": sid},
                headers={**bearer(KEY_B), "X-Tenant": "alpha"},
            ),
        ):
            assert resp.status_code == 404, resp.text
        settle(w)
    assert b["tokens_local"] == 0 and b["tokens_remote"] == 0
    assert b["tokens_computed"] == a["tokens_computed"]
    # B's second request hits B's own pages (the disguise did not make it A)
    assert b2["tokens_remote"] == 0 and b2["tokens_local"] >= N_CHUNKS * CHUNK
    # B did use the index (looked up its chunks, wrote its own entries, looked for the
    # session under its own scope) - just never a key of A's
    assert any(c.upper().startswith("EVALSHA") for c in commands), commands
    b_entries = entries(r) - before_entries - a_entries
    assert len(b_entries) >= N_CHUNKS
    assert touched_fields(commands, b_entries), "MONITOR did not see B's own entries"
    assert touched_fields(commands, a_entries) == set()
    assert touched(commands, a_sessions) == set()

    # -- control: the same capture does see A's keys when tenant A asks, from another worker
    # (nothing local there), and A gets its prompt from the store: the hits B did not get
    # were there to get.
    w2 = spawn("iso-control", store, index, env=WORKER_ENV)
    with monitored(index) as commands:
        a2 = complete(w2, KEY_A2, prompt=PROMPT)
        info = w2.client.get(f"/v1/sessions/{sid}", headers=bearer(KEY_A))
    assert a2["tokens_local"] == 0 and a2["tokens_remote"] == N_CHUNKS * CHUNK
    assert info.status_code == 200 and info.json()["stored"] is True
    assert touched_fields(commands, a_entries)
    assert touched(commands, a_sessions)
    r.close()
