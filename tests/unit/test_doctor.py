"""``kvcloud doctor`` against file+sqlite, real moto_server and redis-server, dead ports and
wrong credentials; and ``kvcloud stats --prometheus``."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from kvcloud import KVCloud
from kvcloud.stores import FileStore
from kvcloud.tools import doctor
from kvcloud.tools.cli import main
from tests.helpers import make_kv, make_ns, make_tokens
from tests.s3_servers import S3Server
from tests.servers import MotoServer, free_port


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["doctor", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _by_name(report: dict) -> dict[tuple[str, str], dict]:
    return {(c["target"], c["name"]): c for c in report["checks"]}


def test_file_and_sqlite_all_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'x' / 'i.db'}"
    rc, report = _doctor(capsys, "--store", store, "--index", index)
    assert rc == 0 and report["ok"]
    checks = _by_name(report)
    for key in [("store", "open"), ("store", "probe"), ("index", "sqlite path")]:
        assert checks[key]["status"] == "ok", checks[key]
    assert checks[("index", "reachable")]["status"] in ("ok", "warn")
    # the probe cleans up after itself
    assert not list((tmp_path / "o").rglob("_doctor/*"))


def test_human_output_is_one_line_per_check(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "KVCLOUD_STORE": f"file://{tmp_path / 'o'}",
        "KVCLOUD_INDEX": f"sqlite://{tmp_path / 'i.db'}",
    }
    r = subprocess.run(
        [sys.executable, "-m", "kvcloud.tools.cli", "doctor"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) >= 4 and all(line.split()[0] in ("ok", "warn") for line in lines)


def test_unwritable_sqlite_dir_fails_with_a_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a regular file where the index's directory should be: unwritable for every user,
    # root included (directory permissions would not bind root, who runs CI)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    rc, report = _doctor(capsys, "--index", f"sqlite://{blocker / 'i.db'}")
    check = _by_name(report)[("index", "sqlite path")]
    assert rc == 1 and check["status"] == "FAIL" and check["fix"]
    # --index alone: no store checks
    assert all(c["target"] == "index" for c in report["checks"])


def test_moto_and_redis_ok(
    moto_server: MotoServer,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the speed verdict is the machine's, not the code's (CI of 55b2cc8: a 0.5 s moto PUT on a
    # loaded runner turned this into "warn"); test_a_slow_store_is_a_warning covers it
    monkeypatch.setattr(doctor, "SLOW_SECONDS", 60.0)
    store = moto_server.store_url(bucket="doctor-ok") + "&create_bucket=true"
    with KVCloud.open(store=store, index=redis_url):
        pass  # creates the bucket
    rc, report = _doctor(
        capsys, "--store", moto_server.store_url("doctor-ok"), "--index", redis_url
    )
    checks = _by_name(report)
    assert rc == 0, report
    assert checks[("store", "bucket")]["status"] == "ok"
    assert checks[("store", "probe")]["status"] == "ok"
    assert checks[("store", "clock skew")]["status"] == "ok"
    assert "answers 412" in checks[("store", "conditional writes")]["detail"]
    assert checks[("index", "redis version")]["detail"][0].isdigit()
    assert checks[("index", "clock skew")]["status"] == "ok"
    assert checks[("index", "maxmemory-policy")]["status"] == "ok"
    client = redis.Redis.from_url(redis_url)
    assert not client.keys("*_doctor*")
    client.close()


class _SlowStore(FileStore):
    def get(self, key: str) -> bytes:
        time.sleep(doctor.SLOW_SECONDS * 1.5)
        return super().get(key)


def test_a_slow_store_is_a_warning_with_its_timings(tmp_path: Path) -> None:
    checks = list(doctor._probe(_SlowStore(tmp_path / "o")))
    assert [(c.name, c.status) for c in checks] == [("probe", "warn")]
    assert "get " in checks[0].detail and "--remote-timeout" in checks[0].fix
    assert not list((tmp_path / "o").rglob("_doctor/*"))
    fast = list(doctor._probe(FileStore(tmp_path / "o")))
    assert [(c.name, c.status) for c in fast] == [("probe", "ok")]


def test_overfull_index_buckets_are_reported(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcloud.indexes import IndexEntry, RedisIndex

    prefix = "doctor" + uuid.uuid4().hex[:8]
    ok_url = f"{redis_url}?prefix={prefix}"
    _, report = _doctor(capsys, "--index", ok_url)
    assert _by_name(report)[("index", "entry buckets")]["detail"] == "no entries yet"
    # 600 entries in one bucket: past the 512 fields Redis keeps compact
    with RedisIndex(f"{ok_url}&buckets=1") as idx:
        idx.register_many(
            "ns", [(f"{i:064x}", IndexEntry(f"k{i}", 16, 1, 0.0)) for i in range(600)]
        )
    rc, report = _doctor(capsys, "--index", f"{ok_url}&buckets=1")
    assert rc == 0  # a warning, not a failure
    check = _by_name(report)[("index", "entry buckets")]
    assert check["status"] == "warn" and "0 of 1 compact" in check["detail"], check
    assert "buckets=" in check["fix"]
    with RedisIndex(f"{ok_url}&buckets=64") as idx:
        idx.register_many(
            "ns2",
            [
                (hashlib.sha256(bytes([i])).hexdigest(), IndexEntry("k", 16, 1, 0.0))
                for i in range(100)
            ],
        )
    client = redis.Redis.from_url(redis_url)
    client.delete(f"{prefix}:h:ns:0")
    client.close()
    _, report = _doctor(capsys, "--index", f"{ok_url}&buckets=64")
    check = _by_name(report)[("index", "entry buckets")]
    assert check["status"] == "ok" and "compact" in check["detail"], check


def test_missing_bucket_and_evicting_policy(
    moto_server: MotoServer, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(redis_url)
    old = client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        rc, report = _doctor(
            capsys, "--store", moto_server.store_url("no-such-bucket"), "--index", redis_url
        )
    finally:
        client.config_set("maxmemory-policy", old)
        client.close()
    checks = _by_name(report)
    assert rc == 1
    bucket = checks[("store", "bucket")]
    assert bucket["status"] == "FAIL" and "does not exist" in bucket["detail"]
    assert ("store", "probe") not in checks  # no pointless probe against a missing bucket
    policy = checks[("index", "maxmemory-policy")]
    assert policy["status"] == "warn" and "without a TTL" in policy["detail"]
    assert "volatile-lru" in policy["fix"]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "KVCLOUD_CONNECT_TIMEOUT": "0.5",
        "KVCLOUD_READ_TIMEOUT": "1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    return subprocess.run(
        [sys.executable, "-m", "kvcloud.tools.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_dead_ports_are_one_clear_line_each() -> None:
    port = free_port()
    store = f"s3://b/p?endpoint_url=http://127.0.0.1:{port}&region=us-east-1&max_attempts=1"
    r = _run_cli("--store", store, "--index", f"redis://:hunter2@127.0.0.1:{port}/0")
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr and "hunter2" not in r.stdout + r.stderr
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2, r.stdout
    assert all(f"127.0.0.1:{port}" in line for line in fails)
    assert "redis-server is running" in fails[1]


def test_wrong_redis_password(tmp_path: Path) -> None:
    from tests.servers import start_redis

    server = start_redis(tmp_path / "r", extra=["--requirepass", "right-pw"])
    try:
        r = _run_cli("--index", f"redis://:wrong-pw@127.0.0.1:{server.port}/0")
    finally:
        server.stop()
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out and "wrong-pw" not in out
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and "authentication failed" in fails[0], r.stdout


# --- stats --prometheus ----------------------------------------------------------------------


def test_stats_prometheus_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    ns = make_ns()
    with KVCloud.open(store=store, index=index) as kv:
        toks = make_tokens(40)
        kv.push(ns, toks, make_kv(ns, 40))
        kv.pull(kv.lookup(ns, toks))
    assert main(["stats", "--store", store, "--index", index, "--prometheus"]) == 0
    text = capsys.readouterr().out
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("kvcloud_index_entries", (("ns", ns.id),))] == 2
    assert samples[("kvcloud_store_objects", ())] == 2
    assert (
        samples[("kvcloud_store_bytes", ())]
        == samples[("kvcloud_index_entry_bytes", (("ns", ns.id),))]
    )
    assert samples[("kvcloud_index_sessions", ())] == 0
    assert samples[("kvcloud_index_counter", (("name", "lookups"),))] == 1


@pytest.mark.integration
@pytest.mark.parametrize(
    ("s3_server", "word"), [("swift", "refuses"), ("rclone", "ignores")], indirect=["s3_server"]
)
def test_servers_without_conditional_writes_are_named(
    s3_server: S3Server, word: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcloud.stores import s3_writes

    s3_writes.forget()  # doctor must find it out, not remember it from another test
    rc, report = _doctor(
        capsys, "--store", s3_server.store_url("doctor-ok", "p"), "--index", redis_url
    )
    checks = _by_name(report)
    assert rc == 0, report
    detail = checks[("store", "conditional writes")]["detail"]
    assert f"{word} If-None-Match" in detail and "HEAD before each PUT" in detail
