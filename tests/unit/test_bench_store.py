"""Smoke runs of ``kvcloud bench store``: tiny layouts, every figure present and consistent,
and nothing left behind. No wall-clock thresholds: benchmarks are not tests."""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvcloud.indexes import open_index
from kvcloud.stores import open_store
from kvcloud.tools.bench import BenchError, BenchLayout, run_store_bench, servers
from kvcloud.tools.cli import main
from tests.servers import MotoServer

TINY = ["--model", "tiny", "--chunk-tokens", "16", "--chunks", "8", "--lookup-iters", "20"]


def _tiny(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        layout=BenchLayout.resolve("tiny", chunk_tokens=16),
        chunks=8,
        repeat=2,
        pull_passes=2,
        lookup_chunks=32,
        lookup_iters=20,
    )
    return {**args, **kw}


def _check_figures(r: dict[str, Any], chunks: int = 8) -> None:
    assert r["bench"] == "store" and r["chunks"] == chunks
    for key in ("cpu_count", "platform", "python", "kvcloud"):
        assert r["machine"][key]
    lay = r["layout"]
    assert lay["chunk_bytes"] == lay["layers"] * 2 * lay["kv_heads"] * lay["head_dim"] * 2 * 16
    assert lay["object_bytes"] > lay["chunk_bytes"]  # the header rides along
    assert r["bytes"] == chunks * lay["object_bytes"]
    assert r["concurrency"] >= 1
    for op in ("push", "pull", "pull_array"):
        pair = r[op]
        for side in ("kvcloud", "baseline"):
            x = pair[side]
            assert x["method"]
            # one push per round; pull_passes pulls of each method per round
            samples = r["repeat"] * (1 if op == "push" else r["pull_passes"])
            assert len(x["seconds"]) == samples and all(s > 0 for s in x["seconds"])
            assert x["gbps_best"] > 0 and x["gbps_median"] > 0
            assert x["gbps_best"] >= x["gbps_median"]
            assert math.isclose(x["gbps_best"], r["bytes"] / min(x["seconds"]) / 1e9)
        for stat in ("best", "median"):
            want = pair["kvcloud"][f"gbps_{stat}"] / pair["baseline"][f"gbps_{stat}"]
            assert math.isclose(pair[f"ratio_{stat}"], want)
    assert r["pull_array"]["baseline"] == r["pull"]["baseline"]
    lk = r["lookup"]
    assert lk["iters"] == 20
    for name in ("kvcloud", "fingerprints", "index_lookup_run", "ping"):
        x = lk[name]
        assert 0 < x["min_ms"] <= x["p50_ms"] <= x["p99_ms"] and x["mean_ms"] > 0
    assert math.isclose(lk["ratio_p99"], lk["kvcloud"]["p99_ms"] / lk["ping"]["p99_ms"])
    assert math.isclose(lk["ratio_p50"], lk["kvcloud"]["p50_ms"] / lk["ping"]["p50_ms"])
    assert r["cleanup"]["kept"] is False and "error" not in r["cleanup"]
    # every round's objects (kvcloud's and the plain client's) and every entry went away
    written = r["warmup_chunks"] + chunks * r["repeat"]  # the warm-up round is smaller
    assert r["cleanup"]["objects_deleted"] >= 2 * written
    assert r["cleanup"]["entries_dropped"] >= written + lk["chunks"]


def _assert_nothing_left(store_url: str, index_url: str) -> None:
    with open_store(store_url) as store:
        assert list(store.list()) == []
    with open_index(index_url) as index:
        assert list(index.iter_entries()) == []
        # the bench takes back its counts, so the deployment's statistics are untouched
        assert all(v == 0 for v in index.counters().values())


def test_embedded_backends(tmp_path: Path) -> None:
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    r = run_store_bench(store, index, **_tiny())
    _check_figures(r)
    assert r["store"] == store and r["pull"]["baseline"]["method"].startswith("file")
    _assert_nothing_left(store, index)
    # not even empty directories of the bench's namespace remain
    assert list((tmp_path / "objects").iterdir()) == []


@pytest.mark.integration
def test_index_memory_figure(redis_url: str) -> None:
    from kvcloud.indexes import RedisIndex, SQLiteIndex
    from kvcloud.tools.bench.lookup import index_memory_bench

    ns_id = f"memtest{uuid.uuid4().hex[:8]}"
    with RedisIndex(redis_url) as index:
        m = index_memory_bench(index, ns_id, 1500)
        assert m is not None and m["entries"] == 1500 and m["buckets"] == index.buckets
        assert index.count_entries(ns_id) == 1500
        assert m["bytes_per_entry"] == (m["used_memory_after"] - m["used_memory_before"]) / 1500
        for rec in list(index.iter_entries(ns_id)):
            index.drop(ns_id, rec.fp)
    assert index_memory_bench(SQLiteIndex(":memory:"), ns_id, 10) is None


def test_moto_and_redis(moto_server: MotoServer, redis_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    store = (
        f"s3://kvcloud/{prefix}?endpoint_url={moto_server.endpoint}"
        "&region=us-east-1&create_bucket=true"
    )
    r = run_store_bench(store, redis_url, concurrency=4, **_tiny())
    _check_figures(r)
    assert r["concurrency"] == 4
    assert r["push"]["baseline"]["method"] == "boto3 put_object"
    assert r["lookup"]["ping"]["method"] == "RedisIndex.ping"
    _assert_nothing_left(store, redis_url)


def test_keep_leaves_everything(tmp_path: Path) -> None:
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    r = run_store_bench(store, index, keep=True, **_tiny(repeat=1))
    assert r["cleanup"] == {"kept": True}
    with open_index(index) as ix:
        assert ix.count_entries(r["namespace"]) > 0


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, index = f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
    out = tmp_path / "bench.json"
    argv = ["bench", "store", "--store", store, "--index", index, *TINY]
    assert main([*argv, "--json", "--json-out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    _check_figures(printed)
    assert printed["repeat"] == 3 and printed["layout"]["model"] == "tiny"
    assert json.loads(out.read_text()) == printed
    _assert_nothing_left(store, index)


@pytest.mark.integration
def test_cli_servers_table(capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(os.environ)
    assert main(["bench", "store", "--servers", *TINY, "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "boto3 get_object" in out and "RedisIndex.ping" in out and "cleaned up" in out
    assert dict(os.environ) == before  # the dummy credentials were only for the run


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--servers", "--store", "file:///x", *TINY]) == 2
    assert "drop --store" in capsys.readouterr().err
    assert main(["bench", "store", "--model", "nope", *TINY[2:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model" in err


def test_missing_server_binaries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(servers.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(servers.shutil, "which", lambda _name: None)
    with pytest.raises(BenchError, match=r"moto_server.*redis-server"):
        servers.find_server_binaries()


def test_layout_overrides() -> None:
    small = BenchLayout.resolve("small")
    assert (small.layers, small.kv_heads, small.head_dim, small.dtype) == (12, 4, 64, "float16")
    custom = BenchLayout.resolve("small", layers=2, dtype="bfloat16", chunk_tokens=8)
    assert custom.model == "custom" and custom.layers == 2 and custom.kv_heads == 4
    assert custom.namespace("x").chunk_bytes == 2 * 2 * 4 * 64 * 2 * 8
    with pytest.raises(BenchError):
        BenchLayout.resolve(None, layers=2)
