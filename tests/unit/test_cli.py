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


# --- help, exit codes, which backends, readers never create ------------------------------------


def _subcommands() -> list[list[str]]:
    import argparse

    from kvcloud.tools.cli import build_parser

    paths: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        paths.append(path)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])

    walk(build_parser(), [])
    return paths


@pytest.mark.parametrize("path", _subcommands(), ids=lambda p: " ".join(p) or "kvcloud")
def test_help_is_plain_text(path: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--help shows no reStructuredText markup from the docstrings it is built from."""
    with pytest.raises(SystemExit) as info:
        main([*path, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: kvcloud")
    for markup in ("``", ":class:", ":func:", ":meth:", ":mod:", ":attr:"):
        assert markup not in text, f"{markup} in kvcloud {' '.join(path)} --help"


def test_top_level_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    status = text[text.index("exit status:") :]
    for line in ("0  healthy", "1  problems found and left", "2  usage or configuration error"):
        assert line in status
    assert "never create a store or an index" in " ".join(text.split())


def test_each_command_names_its_backends_and_where_they_came_from(
    populated, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index, keys, _ = populated
    assert main(["ls", "--store", store, "--index", index]) == 0
    assert capsys.readouterr().err == f"kvcloud: index {index} (--index)\n"
    monkeypatch.setenv("KVCLOUD_STORE", store)
    monkeypatch.setenv("KVCLOUD_INDEX", index)
    assert main(["verify"]) == 0
    err = capsys.readouterr().err
    assert err == f"kvcloud: store {store} (KVCLOUD_STORE) · index {index} (KVCLOUD_INDEX)\n"
    # JSON carries them instead
    assert main(["stats", "--json"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert err == ""
    assert (d["store"], d["index"]) == (store, index)
    assert d["sources"] == {"store": "KVCLOUD_STORE", "index": "KVCLOUD_INDEX"}
    for argv in (["verify", "--json"], ["gc", "--dry-run", "--json"]):
        assert main(argv) == 0
        d = json.loads(capsys.readouterr().out)
        assert (d["store"], d["index"], d["sources"]["index"]) == (store, index, "KVCLOUD_INDEX")
    assert main(["inspect", keys[0], "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["store"] == store and "index" not in d  # a key needs the store only


def test_the_default_backends_are_named_as_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCLOUD_STORE", raising=False)
    monkeypatch.delenv("KVCLOUD_INDEX", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    home = tmp_path / "kvcloud"
    KVCloud.open(store=f"file://{home / 'objects'}", index=f"sqlite://{home / 'index.db'}").close()
    assert main(["stats"]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"kvcloud: store file://{home / 'objects'} (default: KVCLOUD_STORE unset) · "
        f"index sqlite://{home / 'index.db'} (default: KVCLOUD_INDEX unset)\n"
    )


# (argv, which backends it opens); FP16 stands for a 16-hex fingerprint as ls prints it
READERS: list[tuple[list[str], set[str]]] = [
    (["stats"], {"store", "index"}),
    (["stats", "--json"], {"store", "index"}),
    (["stats", "--prometheus"], {"store", "index"}),
    (["stats", "--no-store"], {"index"}),
    (["ls"], {"index"}),
    (["inspect", "FP16"], {"store", "index"}),
    (["inspect", "KEY"], {"store"}),
    (["verify"], {"store", "index"}),
    (["verify", "--deep", "--repair"], {"store", "index"}),
    (["gc", "--dry-run"], {"store", "index"}),
    (["gc", "--json"], {"store", "index"}),
]


@pytest.mark.parametrize("missing", ["store", "index"])
@pytest.mark.parametrize("argv, touches", READERS, ids=lambda a: " ".join(a))
def test_readers_never_create_a_store_or_an_index(
    argv: list[str],
    touches: set[str],
    missing: str,
    populated,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A mistyped file:// directory or sqlite:// file is a one-line error (exit 2), not a
    new empty store or index that then reports 0 entries or drops every entry as missing."""
    if missing not in touches:
        pytest.skip(f"{argv[0]} does not open the {missing}")
    store, index, keys, fp = populated
    typo = {
        "store": tmp_path / "typo" / "objects",
        "index": tmp_path / "typo" / "index.db",
    }[missing]
    store = f"file://{typo}" if missing == "store" else store
    index = f"sqlite://{typo}" if missing == "index" else index
    argv = [fp[:16] if a == "FP16" else keys[0] if a == "KEY" else a for a in argv]
    rc = main([*argv, "--store", store, "--index", index])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"kvcloud {argv[0]}: error: no {missing} at "), err
    assert str(typo) in line and f"KVCLOUD_{missing.upper()}" in line
    assert not (tmp_path / "typo").exists()
    if "--json" in argv or "--prometheus" in argv:
        assert out == ""


def test_inspect_takes_what_ls_prints(populated, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcloud.indexes import IndexEntry

    store, index, keys, fp = populated
    common = ["--store", store, "--index", index]
    assert main(["ls", *common]) == 0
    assert fp[:16] in capsys.readouterr().out
    for target in (fp[:16], fp[:8], fp.upper()):
        assert main(["inspect", target, *common, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["entries"][0]["fp"] == fp and d["objects"][0]["key"] == keys[0]
    ns = d["entries"][0]["ns"]
    assert main(["ls", "--ns", ns[:12], *common, "--json"]) == 0  # ls's ns prefix works too
    assert len(json.loads(capsys.readouterr().out)) == 2
    # two fingerprints sharing the prefix: ambiguous, say so and how to narrow it
    with KVCloud.open(store=store, index=index) as kv:
        for twin in ("ab" * 32, "ab" * 31 + "cd"):
            kv.index.register(ns, twin, IndexEntry(keys[0], 16, 1, 0.0))
    assert main(["inspect", "ab" * 8, *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ambiguous: 2 fingerprints" in err and "more hex digits" in err
    assert main(["inspect", "ab" * 31 + "cd", *common, "--json"]) == 0
    capsys.readouterr()
    assert main(["inspect", "f" * 16, *common]) == 2
    assert "no index entry for fingerprint ffffffffffffffff" in capsys.readouterr().err
    assert main(["inspect", "abc", *common]) == 2  # too short to be a fingerprint
    assert "a prefix of at least 8" in capsys.readouterr().err
