"""Smoke runs of the worker benchmarks (tiny sizes): they must keep working and report every
figure. No timing is asserted: these machines are shared and noisy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.cli import main


def test_bench_suite_quick_writes_every_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert main(["bench", "suite", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"store", "ttft", "costmodel", "decode", "machine"}
    for store in results["store"].values():
        assert store["push"]["ratio_median"] > 0 and store["pull"]["ratio_median"] > 0
        assert store["lookup"]["kvcloud"]["p99_ms"] > 0
    rows = results["ttft"]["rows"]
    assert [r["prefix_tokens"] for r in rows] == [32, 64]
    for r in rows:
        for method in (
            "recompute",
            "restore:file",
            "restore:servers",
            "naive:file",
            "naive:servers",
        ):
            assert r[f"{method}_ms"] > 0, method
    phases = [p["phase"] for p in results["costmodel"]["phases"]]
    assert phases == ["fast", "throttled", "recovered"]
    assert results["decode"]["median_idle"] > 0 and results["decode"]["median_busy"] > 0
    assert (out / "ttft.png").stat().st_size > 1000
    tables = (out / "TABLES.md").read_text()
    assert "## TTFT" in tables and "## Cost model" in tables


def test_bench_ttft_restores_what_the_pusher_pushed(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert (
        main(
            [
                "bench",
                "ttft",
                "--model",
                "tiny",
                "--chunk-tokens",
                "16",
                "--lengths",
                "48",
                "--backends",
                "file",
                "--restores",
                "2",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    row = report["rows"][0]
    # the restoring process never saw the prompt: its KV came from the store, all but the
    # last token (recomputed to produce logits); a fresh engine's cost model has measured no
    # store yet, so it always tries the first hit
    assert row["restored_tokens:file"] == 47
    assert row["recompute_ms"] > 0 and row["restore:file_ms"] > 0
    # --restores: that many timed restores per method, the median reported
    for method in ("restore:file", "naive:file"):
        assert len(report["raw_ms"][method]["48"]) == 2


@pytest.mark.parametrize("option", ["--restores", "--repeat"])
def test_bench_ttft_refuses_zero_runs(option: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "ttft", "--model", "tiny", option, "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least 1, got 0" in err and "Traceback" not in err
