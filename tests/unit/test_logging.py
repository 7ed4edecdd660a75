"""Structured logs and request ids: ``--log-format json`` writes one JSON object per line,
records inside a request carry its id, the id is echoed, and no secret reaches the log."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from workers.config import WorkerOptions
from workers.engine import Engine
from workers.http.server import JsonFormatter, RequestIdFilter, create_app

REPO = Path(__file__).resolve().parents[2]
MASTER_SECRET = "log-test-master-secret-8c1f"
API_KEY = "sk-logtest-0123456789abcdef"
AWS_SECRET = "aws-secret-for-log-test-77"


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, Engine]:
    engine = Engine(WorkerOptions(model="tiny", cache_pages=16, chunk_tokens=16))
    with TestClient(create_app(engine)) as c:
        yield c, engine  # type: ignore[misc]


def test_request_id_is_echoed_or_generated(served: tuple[TestClient, Engine]) -> None:
    client, _ = served
    r = client.get("/healthz", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    generated = client.get("/healthz").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # an id that could forge a log line or a header is replaced, not echoed
    bad = client.get("/healthz", headers={"X-Request-Id": "x\tinjected {json}"})
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    # errors carry one too
    r = client.post("/v1/completions", json={}, headers={"X-Request-Id": "err-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "err-1"


def test_records_inside_a_request_carry_its_id(
    served: tuple[TestClient, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, engine = served
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Capture()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter(secrets=[]))
    engine_log = logging.getLogger("workers.engine")
    real_flush = engine.flush_session

    def logging_flush(session_id: str, tenant: str) -> object:
        # runs in the server's thread pool, like every engine call
        engine_log.warning("flushing %s", session_id)
        return real_flush(session_id, tenant)

    monkeypatch.setattr(engine, "flush_session", logging_flush)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        r = client.post("/v1/sessions/sess_unknown/flush", headers={"X-Request-Id": "rid-42"})
        assert r.headers["x-request-id"] == "rid-42"
        engine_log.warning("outside any request")
    finally:
        root.removeHandler(handler)
    parsed = [json.loads(line) for line in records]
    assert all({"ts", "level", "logger", "msg"} <= set(p) for p in parsed)
    inside = [p for p in parsed if p["msg"] == "flushing sess_unknown"]
    assert inside and inside[0]["request_id"] == "rid-42", parsed
    outside = [p for p in parsed if p["msg"] == "outside any request"]
    assert outside and "request_id" not in outside[0]


def test_json_formatter_scrubs_secret_env_values() -> None:
    fmt = JsonFormatter(secrets=None)
    env_secret = os.environ.get("KVCLOUD_SECRET")
    assert env_secret  # conftest sets one
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key %s", (env_secret,), None)
    out = json.loads(fmt.format(record))
    assert env_secret not in out["msg"] and "***" in out["msg"]


def test_serve_log_format_json_end_to_end(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVCLOUD_STORE": f"file://{tmp_path / 'objects'}",
        "KVCLOUD_INDEX": f"sqlite://{tmp_path / 'index.db'}",
        "KVCLOUD_SECRET": MASTER_SECRET,
        "KVCLOUD_API_KEYS": f"{API_KEY}=alpha",
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
    }
    cmd = [
        sys.executable,
        "-m",
        "workers.cli",
        "serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--chunk-tokens",
        "16",
        "--log-format",
        "json",
        "--log-level",
        "debug",
    ]
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"ready on (http://[^\s\"]+)", log_path.read_text())
            url = m.group(1) if m else None
            time.sleep(0.1)
        assert url, log_path.read_text()
        auth = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "e2e-rid-1"}
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post(
                "/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 2}, headers=auth
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "e2e-rid-1"
            bad = http.post(
                "/v1/completions",
                json={"prompt": "x"},
                headers={"Authorization": f"Bearer {API_KEY}x"},
            )
            assert bad.status_code == 401 and bad.headers["x-request-id"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) > 3
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any("ready on" in r["msg"] for r in records)
    assert any(r.get("request_id") == "e2e-rid-1" for r in records), text[-3000:]
    for secret in (MASTER_SECRET, API_KEY, AWS_SECRET):
        assert secret not in text
