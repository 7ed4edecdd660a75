"""infra/local/start.sh and stop.sh: the no-docker stack (redis-server, SeaweedFS, two
workers, the stats exporter, Prometheus when installed) comes up, moves a session between its
workers, answers ``kvcloud stats``, shows the move in the exporter's and Prometheus's figures,
and stops without leaving a process behind."""

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
from prometheus_client.parser import text_string_to_metric_families

from tests.local_stack import alive, stack_exports
from tests.servers import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "infra" / "local" / "start.sh"
STOP = ROOT / "infra" / "local" / "stop.sh"
GEN = {"max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
HAVE_PROMETHEUS = shutil.which("prometheus") is not None


def _pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (state / "pids").glob("*.pid")}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    state = tmp_path / "state"
    names = ("REDIS", "S3", "WORKER1", "WORKER2", "EXPORTER", "PROMETHEUS")
    ports = {name: free_port() for name in names}
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
        "KVCLOUD_LOCAL_PROMETHEUS": "auto",
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
        assert f"http://127.0.0.1:{ports['EXPORTER']}/metrics" in started.stdout
        assert (f"http://127.0.0.1:{ports['PROMETHEUS']}" in started.stdout) == HAVE_PROMETHEUS
        assert "KVCLOUD_STORE=" in started.stdout and "KVCLOUD_INDEX=" in started.stdout
        yield env, ports
    finally:
        pids = _pids(state) if (state / "pids").is_dir() else {}
        subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=60)
        for pid in pids.values():  # never leave a process behind, even when a test failed
            if alive(pid):
                os.kill(pid, 9)


def _poll(what: str, check: object, timeout: float = 30.0) -> object:
    """``check()`` until it returns something true; its last exception or value on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()  # type: ignore[operator]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            result, last = None, repr(exc)
        else:
            last = repr(result)
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s (last: {last})")
        time.sleep(0.5)


def _exporter_store_objects(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).raise_for_status().text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["kvcloud_stats_up"] == 1
    return values["kvcloud_store_objects"]


def _target_health(port: int) -> dict[tuple[str, str, str], str]:
    """(job, instance, worker label) -> health of every active Prometheus target."""
    body = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).raise_for_status()
    return {
        (t["labels"]["job"], t["labels"]["instance"], t["labels"].get("worker", "")): t["health"]
        for t in body.json()["data"]["activeTargets"]
    }


def _prom_value(port: int, query: str) -> float:
    body = httpx.get(
        f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5
    ).raise_for_status()
    result = body.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def _check_monitoring(state: Path, ports: dict[str, int]) -> None:
    # the exporter rescans every 5 s: the objects worker 1 just flushed show up
    assert _poll(
        "exporter kvcloud_store_objects > 0", lambda: _exporter_store_objects(ports["EXPORTER"])
    )
    if not HAVE_PROMETHEUS:
        return
    prom = ports["PROMETHEUS"]
    # what `make demo DEMO_ARGS="--prometheus-sd …"` does for its own workers: a file_sd list
    sd = state / "prometheus" / "targets" / "test.json"
    sd.write_text(
        json.dumps([{"targets": [f"127.0.0.1:{ports['WORKER2']}"], "labels": {"worker": "sd"}}])
    )
    expected = {
        ("kvcloud-worker", f"127.0.0.1:{ports['WORKER1']}", ""),
        ("kvcloud-worker", f"127.0.0.1:{ports['WORKER2']}", ""),
        ("kvcloud-worker", f"127.0.0.1:{ports['WORKER2']}", "sd"),
        ("kvcloud-stats", f"127.0.0.1:{ports['EXPORTER']}", ""),
    }

    def all_up() -> bool:
        health = _target_health(prom)
        assert set(health) <= expected, f"unexpected targets: {set(health) - expected}"
        return set(health) == expected and set(health.values()) == {"up"}

    _poll("Prometheus: every worker and exporter target up", all_up)
    # the figures the dashboard plots moved: the workers' tokens and the store's objects
    assert _poll(
        "Prometheus has the workers' prompt tokens",
        lambda: _prom_value(prom, 'sum(kvcloud_worker_prompt_tokens_total{job="kvcloud-worker"})'),
    )
    assert _poll(
        "Prometheus has the exporter's object count",
        lambda: _prom_value(prom, 'kvcloud_store_objects{job="kvcloud-stats"}'),
    )


def _check_s3_server(exports: dict[str, str]) -> None:
    """The stack's S3 is a real server (SeaweedFS) that honours conditional writes, and the
    user kvcloud gets is limited to its bucket."""
    import boto3
    from botocore.exceptions import ClientError

    from kvcloud.stores import S3Config

    cfg = S3Config.from_url(exports["KVCLOUD_STORE"], env={})
    s3 = boto3.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
    )
    s3.put_object(Bucket=cfg.bucket, Key="probe", Body=b"first")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=cfg.bucket, Key="probe", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=cfg.bucket, Key="probe")["Body"].read() == b"first"
    s3.delete_object(Bucket=cfg.bucket, Key="probe")
    with pytest.raises(ClientError) as denied:
        s3.create_bucket(Bucket="not-kvclouds")
    assert denied.value.response["Error"]["Code"] == "AccessDenied"


def test_local_stack_moves_a_session_and_stops_cleanly(
    stack: tuple[dict[str, str], dict[str, int]],
) -> None:
    env, ports = stack
    state = Path(env["KVCLOUD_LOCAL_STATE"])
    pids = _pids(state)
    expected = {"redis", "s3", "worker1", "worker2", "exporter"}
    assert set(pids) == expected | ({"prometheus"} if HAVE_PROMETHEUS else set())
    assert all(alive(pid) for pid in pids.values())

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
        assert flush["stored"] and flush["kv_tokens"] > 0
        second = w2.post(
            "/v1/completions", json={"prompt": " and moves on.", "session_id": sid, **GEN}
        ).raise_for_status()
        assert second.json()["kvcloud"]["tokens_remote"] > 0

    # `kvcloud stats` against the stack, configured the way start.sh tells a user to
    exports = stack_exports(state)
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

    _check_s3_server(exports)
    _check_monitoring(state, ports)

    stopped = subprocess.run(
        ["bash", str(STOP)], env=env, capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 5  # reaping may lag the exit a little
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert not list((state / "pids").glob("*.pid"))
    # idempotent
    again = subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=30)
    assert again.returncode == 0
