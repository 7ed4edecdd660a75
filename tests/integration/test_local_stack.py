"""infra/local/start.sh and stop.sh: the no-docker stack (redis-server, moto_server, two
workers) comes up, moves a session between its workers, answers ``kvcloud stats``, and
stops without leaving a process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "infra" / "local" / "start.sh"
STOP = ROOT / "infra" / "local" / "stop.sh"
GEN = {"max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not any(line.startswith("State:") and "Z" in line for line in status.splitlines())


def _pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (state / "pids").glob("*.pid")}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    state = tmp_path / "state"
    ports = {name: free_port() for name in ("REDIS", "S3", "WORKER1", "WORKER2")}
    env = {
        **os.environ,
        "KVCLOUD_LOCAL_STATE": str(state),
        "KVCLOUD_LOCAL_VENV": str(Path(sys.executable).parent.parent),
        "KVCLOUD_LOCAL_TIMEOUT": "40",
        "KVCLOUD_LOCAL_STOP_TIMEOUT": "20",
        "KVCLOUD_WORKER_MODEL": "tiny",
        "KVCLOUD_CHUNK_TOKENS": "16",
        "KVCLOUD_CACHE_PAGES": "32",
        "KVCLOUD_SECRET": "test-local-stack-secret",
        **{f"KVCLOUD_LOCAL_{name}_PORT": str(port) for name, port in ports.items()},
    }
    for var in ("KVCLOUD_STORE", "KVCLOUD_INDEX"):
        env.pop(var, None)
    try:
        started = subprocess.run(
            ["bash", str(START)], env=env, capture_output=True, text=True, timeout=60
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{ports['WORKER1']}" in started.stdout
        assert "KVCLOUD_STORE=" in started.stdout and "KVCLOUD_INDEX=" in started.stdout
        yield env, ports
    finally:
        pids = _pids(state) if (state / "pids").is_dir() else {}
        subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=60)
        for pid in pids.values():  # never leave a process behind, even when a test failed
            if _alive(pid):
                os.kill(pid, 9)


def test_local_stack_moves_a_session_and_stops_cleanly(
    stack: tuple[dict[str, str], dict[str, int]],
) -> None:
    env, ports = stack
    state = Path(env["KVCLOUD_LOCAL_STATE"])
    pids = _pids(state)
    assert set(pids) == {"redis", "s3", "worker1", "worker2"}
    assert all(_alive(pid) for pid in pids.values())

    w1 = httpx.Client(base_url=f"http://127.0.0.1:{ports['WORKER1']}", timeout=30)
    w2 = httpx.Client(base_url=f"http://127.0.0.1:{ports['WORKER2']}", timeout=30)
    with w1, w2:
        sid = w1.post("/v1/sessions").raise_for_status().json()["id"]
        first = w1.post(
            "/v1/completions",
            json={"prompt": "the local stack keeps " * 6, "session_id": sid, **GEN},
        ).raise_for_status()
        assert first.json()["kvcloud"]["session_tokens"] > 0
        flush = w1.post(f"/v1/sessions/{sid}/flush").raise_for_status().json()
        assert flush["chunks_pushed"] > 0
        second = w2.post(
            "/v1/completions", json={"prompt": " and moves on.", "session_id": sid, **GEN}
        ).raise_for_status()
        assert second.json()["kvcloud"]["tokens_remote"] > 0

    # `kvcloud stats` against the stack, configured the way start.sh tells a user to
    exports = {}
    for line in (state / "env").read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = value.strip("'")
    assert exports["KVCLOUD_STORE"].startswith("s3://")
    assert exports["KVCLOUD_INDEX"] == f"redis://127.0.0.1:{ports['REDIS']}/0"
    kvcloud = Path(sys.executable).with_name("kvcloud")
    stats = subprocess.run(
        [str(kvcloud), "stats", "--json"],
        env={**env, **exports},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert report["entries"] > 0 and report["objects"] > 0 and report["sessions"] >= 1

    stopped = subprocess.run(
        ["bash", str(STOP)], env=env, capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 5  # reaping may lag the exit a little
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in pids.items() if _alive(pid)]
    assert not list((state / "pids").glob("*.pid"))
    # idempotent
    again = subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=30)
    assert again.returncode == 0
