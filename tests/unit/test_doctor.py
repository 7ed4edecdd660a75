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
from kvcloud.probe import key_id
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


def _embedded(tmp_path: Path) -> tuple[str, str]:
    """A file:// store and sqlite:// index that exist (doctor never creates them)."""
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'x' / 'i.db'}"
    KVCloud.open(store=store, index=index).close()
    return store, index


def test_file_and_sqlite_all_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, index = _embedded(tmp_path)
    rc, report = _doctor(capsys, "--store", store, "--index", index)
    assert rc == 0 and report["ok"]
    assert (report["store"], report["index"]) == (store, index)
    assert report["sources"] == {"store": "--store", "index": "--index"}
    checks = _by_name(report)
    for key in [("store", "probe"), ("index", "sqlite path"), ("index", "round trip")]:
        assert checks[key]["status"] == "ok", checks[key]
    assert checks[("index", "reachable")]["status"] in ("ok", "warn")
    # opening proves nothing (backends open lazily): no line claims it
    assert ("store", "open") not in checks and ("index", "open") not in checks
    assert checks[("client", "key id")]["status"] == "info"
    assert checks[("client", "key id")]["detail"].startswith(
        key_id(b"test-master-secret", "default")
    )
    # the probes clean up after themselves
    assert not list((tmp_path / "o").rglob("_probe/*"))
    with KVCloud.open(store=store, index=index) as kv:
        assert list(kv.index.iter_sessions()) == []


def test_human_output_is_one_line_per_check(tmp_path: Path) -> None:
    store, index = _embedded(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "KVCLOUD_STORE": store, "KVCLOUD_INDEX": index}
    r = subprocess.run(
        [sys.executable, "-m", "kvcloud.tools.cli", "doctor"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) >= 4 and all(line.split()[0] in ("ok", "warn", "info") for line in lines)
    # no KVCLOUD_SECRET: the development secret is a warning, not a failure
    assert any(line.startswith("warn client secret: KVCLOUD_SECRET is unset") for line in lines)
    assert r.stderr == f"kvcloud: store {store} (KVCLOUD_STORE) · index {index} (KVCLOUD_INDEX)\n"


def test_missing_store_and_index_fail_and_are_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """doctor is a reader: a mistyped file:// or sqlite:// path is a FAIL with the fix,
    never a new empty store or index (which would then look healthy)."""
    store, index = f"file://{tmp_path / 'typo'}", f"sqlite://{tmp_path / 'd' / 'typo.db'}"
    rc, report = _doctor(capsys, "--store", store, "--index", index)
    checks = _by_name(report)
    assert rc == 1 and not report["ok"]
    assert checks[("store", "open")]["status"] == "FAIL"
    assert "no store at" in checks[("store", "open")]["detail"]
    assert "KVCLOUD_STORE" in checks[("store", "open")]["fix"]
    assert checks[("index", "open")]["status"] == "FAIL"
    assert "no index at" in checks[("index", "open")]["detail"]
    assert "KVCLOUD_INDEX" in checks[("index", "open")]["fix"]
    assert not (tmp_path / "typo").exists() and not (tmp_path / "d").exists()
    # --index alone: no store checks
    rc, report = _doctor(capsys, "--index", index)
    assert rc == 1 and {c["target"] for c in report["checks"]} == {"client", "index"}


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
    assert checks[("index", "round trip")]["status"] == "ok"
    client = redis.Redis.from_url(redis_url)
    assert not client.keys("*_probe*")
    client.close()


class _SlowStore(FileStore):
    def get(self, key: str) -> bytes:
        time.sleep(doctor.SLOW_SECONDS * 1.5)
        return super().get(key)


def test_a_slow_store_is_a_warning_with_its_timings(tmp_path: Path) -> None:
    checks = list(doctor._probe(_SlowStore(tmp_path / "o")))
    assert [(c.name, c.status) for c in checks] == [("probe", "warn")]
    assert "get " in checks[0].detail and "--remote-timeout" in checks[0].fix
    assert not list((tmp_path / "o").rglob("_probe/*"))
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
    # nothing answered, so no line about the store or the index says ok
    assert not [line for line in r.stdout.splitlines() if line.startswith("ok")], r.stdout


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


# --- doctor --vllm-config ---------------------------------------------------------------------

TRANSFER = {
    "kv_connector": "KVCloudConnector",
    "kv_connector_module_path": "kvcloud.integrations.vllm",
    "kv_role": "kv_both",
}


def _vllm(
    capsys: pytest.CaptureFixture[str], transfer: dict | str, *extra: str
) -> tuple[int, dict, str]:
    value = transfer if isinstance(transfer, str) else json.dumps(transfer)
    rc = main(["doctor", "--vllm-config", value, "--json", *extra])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out else {}), err


def test_vllm_config_checks_what_vllm_would_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index = _embedded(tmp_path)
    monkeypatch.setenv("KVCLOUD_SECRET", "pod-secret")
    monkeypatch.setenv("KVCLOUD_LOAD_MODE", "sync")  # the environment applies, as in vLLM
    extra = {"store": store, "index": index, "read_timeout": 3, "tenant": "t1"}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({**TRANSFER, "kv_connector_extra_config": extra}))
    rc, report, err = _vllm(capsys, f"@{path}")
    assert rc == 0 and report["ok"], report
    checks = _by_name(report)
    assert checks[("vllm", "connector")]["status"] == "ok"
    settings = checks[("vllm", "settings")]["detail"]
    assert "load mode sync" in settings and "write policy write-through" in settings
    assert "read 3 s" in settings and "tenant t1" in settings
    assert report["key_id"] == key_id(b"pod-secret", "t1")
    assert checks[("client", "key id")]["detail"].startswith(report["key_id"])
    assert report["sources"] == {
        "store": "kv_connector_extra_config.store",
        "index": "kv_connector_extra_config.index",
    }
    assert (report["store"], report["index"], report["read_timeout"]) == (store, index, 3)
    for key in [("store", "probe"), ("index", "round trip"), ("vllm", "start probe")]:
        assert checks[key]["status"] == "ok", checks[key]
    assert err == ""  # --json: the JSON names them
    assert main(["doctor", "--vllm-config", f"@{path}"]) == 0
    assert capsys.readouterr().err == (
        f"kvcloud: store {store} (kv_connector_extra_config.store) · "
        f"index {index} (kv_connector_extra_config.index)\n"
    )
    # another secret: another key id, so the two pods would not share KV
    monkeypatch.setenv("KVCLOUD_SECRET", "other-secret")
    _, other, _ = _vllm(capsys, f"@{path}")
    assert other["key_id"] != report["key_id"]


def test_vllm_config_from_the_environment_and_the_connector_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index = _embedded(tmp_path)
    monkeypatch.setenv("KVCLOUD_STORE", store)
    monkeypatch.setenv("KVCLOUD_INDEX", index)
    transfer = {**TRANSFER, "kv_connector_module_path": "kvcloud.integrations.vllm.connector"}
    rc, report, _ = _vllm(capsys, transfer)
    assert rc == 0, report
    assert report["sources"] == {"store": "KVCLOUD_STORE", "index": "KVCLOUD_INDEX"}


@pytest.mark.parametrize(
    ("change", "says", "fix"),
    [
        ({"kv_connector": "LMCacheConnectorV1"}, "another connector", '"KVCloudConnector"'),
        ({"kv_connector_module_path": None}, "is missing", "kvcloud.integrations.vllm"),
        ({"kv_connector_module_path": "kvcloud.vllm"}, "'kvcloud.vllm'", "kv_connector_module"),
        ({"kv_role": None}, "kv_role is None", "kv_both"),
    ],
)
def test_vllm_config_wrong_connector_is_a_fail_with_the_fix(
    change: dict,
    says: str,
    fix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, index = _embedded(tmp_path)
    transfer = {k: v for k, v in {**TRANSFER, **change}.items() if v is not None}
    transfer["kv_connector_extra_config"] = {"store": store, "index": index}
    rc, report, _ = _vllm(capsys, transfer)
    check = _by_name(report)[("vllm", "connector")]
    assert rc == 1 and check["status"] == "FAIL"
    assert says in check["detail"] and fix in check["fix"], check


def test_vllm_config_on_the_embedded_default_fails_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without KVCLOUD_STORE/KVCLOUD_INDEX each vLLM writes a private file:// + sqlite://
    under ~/.cache that no other pod reads: for a fleet that is the failure to report."""
    monkeypatch.delenv("KVCLOUD_STORE", raising=False)
    monkeypatch.delenv("KVCLOUD_INDEX", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rc, report, err = _vllm(capsys, TRANSFER)
    checks = _by_name(report)
    assert rc == 1
    for role in ("store", "index"):
        check = checks[("vllm", role)]
        assert check["status"] == "FAIL" and "private to this machine" in check["detail"]
        assert check["fix"].startswith("set KVCLOUD_STORE and KVCLOUD_INDEX")
    assert ("store", "probe") not in checks  # nothing probed (or created) there
    assert not (tmp_path / "cache").exists()
    assert report["sources"]["store"] == "default: KVCLOUD_STORE unset" and err == ""


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a JSON object"),
        ("@/nonexistent/kv.json", "cannot read it"),
        (json.dumps({**TRANSFER, "kv_connector_extra_config": {"nope": 1}}), "unknown"),
        (json.dumps({**TRANSFER, "kv_connector_extra_config": {"secret": "x"}}), "secret"),
        (json.dumps({**TRANSFER, "kv_connector_extra_config": {"load_mode": "x"}}), "load_mode"),
    ],
)
def test_vllm_config_errors_exit_2_in_one_line(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, report, err = _vllm(capsys, value)
    assert rc == 2 and report == {}
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvcloud doctor: error: ") and says in line, err


def test_vllm_config_rejects_what_the_environment_sets_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's write-back is not the connector's: vLLM would refuse to start."""
    monkeypatch.setenv("KVCLOUD_WRITE_POLICY", "write-back")
    rc, _, err = _vllm(capsys, TRANSFER)
    assert rc == 2 and "write_policy 'write-back'" in err
    store, _ = _embedded(tmp_path)
    monkeypatch.delenv("KVCLOUD_WRITE_POLICY")
    rc, _, err = _vllm(capsys, TRANSFER, "--store", store)
    assert rc == 2 and "drop --store/--index" in err


def test_vllm_config_probes_with_the_connectors_timeouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis that never answers costs the connector's read timeout, not kvcloud's own."""
    import socket

    store, _ = _embedded(tmp_path)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    port = hung.getsockname()[1]
    extra = {"store": store, "index": f"redis://127.0.0.1:{port}/0", "read_timeout": 0.3}
    try:
        start = time.monotonic()
        rc, report, _ = _vllm(capsys, {**TRANSFER, "kv_connector_extra_config": extra})
        elapsed = time.monotonic() - start
    finally:
        hung.close()
    assert rc == 1 and elapsed < 10
    check = _by_name(report)[("index", "reachable")]
    assert check["status"] == "FAIL" and f"127.0.0.1:{port}" in check["detail"]


def test_vllm_config_imports_neither_vllm_nor_torch(tmp_path: Path) -> None:
    store, index = _embedded(tmp_path)
    transfer = json.dumps(
        {**TRANSFER, "kv_connector_extra_config": {"store": store, "index": index}}
    )
    code = (
        "import sys\n"
        "from kvcloud.tools.cli import main\n"
        f"rc = main(['doctor', '--vllm-config', {transfer!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print('RC', rc, 'HEAVY', heavy)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "KVCLOUD_SECRET": "s"},
    )
    assert "RC 0 HEAVY []" in r.stdout, r.stdout + r.stderr


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
