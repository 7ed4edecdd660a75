"""The GPU restore benchmark (scripts/bench/bench_gpu_restore.py) runs anywhere torch does: here on
CPU with a tiny Llama, from file://, its restore checked bit for bit against the prefill's KV
(the script raises on a mismatch) and its table written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_on_cpu_with_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_gpu_restore.py"),
         "--shape", "tiny", "--tokens", "512,1024", "--stores", "file", "--device", "cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [512, 1024]
    for r in rows:
        # 4 layers × 2 × tokens × 2 KV heads × 32 × 4 bytes
        assert r["kv_bytes"] == 4 * 2 * r["tokens"] * 2 * 32 * 4
        assert r["prefill_s"] > 0 and r["file_restore_s"] > 0
    assert "| 1024 |" in run.stdout
