from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcloud import KVCloud
from kvcloud.tools.cli import main
from tests.helpers import make_kv, make_ns, make_tokens


def test_estimate_prints_the_seed_example_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "estimate",
        "--layers",
        "32",
        "--tokens",
        "8192",
        "--kv-dim",
        "512",
        "--bytes-per-element",
        "1",
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "268,435,456 bytes = 0.25 GiB = 0.27 GB"
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes"] == 268_435_456 and d["gib"] == 0.25 and round(d["gb"], 2) == 0.27


def test_estimate_from_model_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "small", "--tokens", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_token"] == 12 * 1024 and d["bytes"] == 48 * 2**20
    assert (
        main(["estimate", "--model", "llama-3-8b", "--tokens", "1", "--dtype", "int8", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["bytes"] == 32 * 1024 * 2


def test_estimate_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers" in err and "Traceback" not in err
    assert main(["estimate", "--model", "nope", "--tokens", "5"]) == 2


@pytest.fixture
def populated(tmp_path: Path) -> tuple[str, str, list[str], str]:
    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    ns = make_ns()
    with KVCloud.open(store=store, index=index) as kv:
        toks = make_tokens(40)
        res = kv.push(ns, toks, make_kv(ns, 40))
        fp = kv.fingerprints(ns, toks)[0].hex()
        kv.pull(kv.lookup(ns, toks))
    return store, index, res.keys, fp


def test_stats_ls_inspect_json(populated, capsys: pytest.CaptureFixture[str]) -> None:
    store, index, keys, fp = populated
    common = ["--store", store, "--index", index, "--json"]
    assert main(["stats", *common]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["entries"] == 2 and s["objects"] == 2 and s["object_bytes"] == s["entry_bytes"]
    assert s["counters"]["lookups"] == 1 and s["counters"]["chunks_hit"] == 2
    assert main(["ls", *common]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["object_key"] for r in rows) == sorted(keys)
    assert main(["inspect", keys[0], *common]) == 0
    obj = json.loads(capsys.readouterr().out)["objects"][0]
    assert obj["digest_ok"] and obj["header"]["n_tokens"] == 16
    assert main(["inspect", fp, *common]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["entries"][0]["fp"] == fp and d["objects"][0]["key"] == keys[0]


def test_inspect_reports_corruption(populated, capsys: pytest.CaptureFixture[str]) -> None:
    store, index, keys, _ = populated
    path = Path(store.removeprefix("file://")) / keys[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert main(["inspect", keys[0], "--store", store, "--index", index, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["objects"][0]["digest_ok"] is False


def test_human_output_and_env_vars(populated, monkeypatch: pytest.MonkeyPatch) -> None:
    store, index, _, _ = populated
    env = {"KVCLOUD_STORE": store, "KVCLOUD_INDEX": index, "PATH": "/usr/bin:/bin"}
    for cmd in (["stats"], ["ls"]):
        out = subprocess.run(
            [sys.executable, "-m", "kvcloud.tools.cli", *cmd],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert make_ns().id[:12] in out


def test_unreachable_index_is_one_clear_line(tmp_path: Path) -> None:
    from tests.servers import free_port

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcloud.tools.cli",
            "stats",
            "--no-store",
            "--index",
            f"redis://:hunter2@127.0.0.1:{free_port()}/0",
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "KVCLOUD_CONNECT_TIMEOUT": "0.5"},
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "hunter2" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "127.0.0.1" in r.stderr


def _scrape(port: int) -> dict[str, float]:
    """Unlabelled samples plus label-summed ones, by sample name."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_stats_exporter_serves_figures_that_move(tmp_path: Path) -> None:
    """``kvcloud stats --serve`` rescans on its interval: a push between two scrapes shows
    up as more entries and objects; SIGTERM stops it cleanly."""
    import signal
    import time

    from tests.servers import free_port

    store, index = f"file://{tmp_path / 'o'}", f"sqlite://{tmp_path / 'i.db'}"
    ns = make_ns()
    with KVCloud.open(store=store, index=index) as kv:
        kv.push(ns, make_tokens(40, seed=1), make_kv(ns, 40))
    port = free_port()
    argv = [sys.executable, "-m", "kvcloud.tools.cli", "stats", "--serve", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [*argv, "--interval", "0.2", "--store", store, "--index", index],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def wait_for(pred) -> dict[str, float]:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 30
            while True:
                try:
                    m = _scrape(port)
                    if pred(m):
                        return m
                except OSError:
                    pass
                assert time.monotonic() < deadline, "exporter never showed the expected figures"
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)

        m = wait_for(lambda m: m.get("kvcloud_index_entries") == 2)
        assert m["kvcloud_store_objects"] == 2 and m["kvcloud_stats_up"] == 1
        assert m["kvcloud_index_entry_bytes"] == m["kvcloud_store_bytes"] > 0
        with KVCloud.open(store=store, index=index) as kv:
            kv.push(ns, make_tokens(40, seed=2), make_kv(ns, 40, seed=2))
        m = wait_for(lambda m: m.get("kvcloud_index_entries") == 4)
        assert m["kvcloud_store_objects"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
    assert rc == 0


def test_stats_exporter_keeps_last_figures_when_a_scan_fails() -> None:
    from prometheus_client import generate_latest

    from kvcloud.errors import StoreUnavailableError
    from kvcloud.tools.exporter import StatsExporter

    results: list[object] = [
        {
            "namespaces": {"n1": {"entries": 3, "bytes": 30, "tokens": 48}},
            "sessions": 1,
            "counters": {"lookups": 5},
            "objects": 3,
            "object_bytes": 30,
            "collected_at": 1.0,
        },
        StoreUnavailableError("store s3://b/p (endpoint http://x) unreachable"),
    ]

    def collect() -> dict:  # type: ignore[type-arg]
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r  # type: ignore[return-value]

    exp = StatsExporter(collect, interval=1)
    assert exp.scan_once() is True
    assert exp.scan_once() is False
    text = generate_latest(exp.registry).decode()
    assert "kvcloud_stats_up 0.0" in text
    assert "kvcloud_stats_scan_failures_total 1.0" in text
    assert 'kvcloud_index_entries{ns="n1"} 3.0' in text and "kvcloud_store_objects 3.0" in text


@pytest.mark.parametrize(
    "value, expected",
    [
        ("9108", ("127.0.0.1", 9108)),
        (":9", ("127.0.0.1", 9)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        ("[::1]:81", ("::1", 81)),
    ],
)
def test_serve_address(value: str, expected: tuple[str, int]) -> None:
    from kvcloud.tools.exporter import parse_listen

    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", ["", "host:", "x:99999", "abc"])
def test_serve_address_rejects_garbage(value: str) -> None:
    from kvcloud.errors import KVCloudError
    from kvcloud.tools.exporter import parse_listen

    with pytest.raises(KVCloudError):
        parse_listen(value)
