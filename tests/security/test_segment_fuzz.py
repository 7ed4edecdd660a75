"""The segment decoder under atheris (libFuzzer), a bounded number of runs.

The target is tests/security/fuzz_segment.py; atheris.Fuzz() exits the process, so it runs as a
subprocess. hypothesis fuzzes the same decoder in tests/unit/test_segment.py; this adds
coverage-guided mutation of valid objects.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")  # wheels exist for Linux x86_64 only; see pyproject's dev extra

REPO = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("KVCLOUD_FUZZ_RUNS", "8000"))  # ~10 s; raise it for a longer hunt
SEED = int(os.environ.get("KVCLOUD_FUZZ_SEED", "1"))  # fixed: the same inputs every CI run


def _fuzz(tmp_path: Path, *flags: str, code: str | None = None) -> subprocess.CompletedProcess:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir(exist_ok=True)
    argv = [
        "fuzz_segment",
        f"-runs={RUNS}",
        f"-seed={SEED}",
        "-rss_limit_mb=1024",  # the process: beyond it libFuzzer reports out-of-memory
        "-max_len=65536",
        "-timeout=20",  # one input taking this long is a hang
        f"-artifact_prefix={artifacts}/",
        *flags,
    ]
    script = code or "import sys, tests.security.fuzz_segment as f; f.main(sys.argv[1:])"
    # libFuzzer's RSS limit reads the peak RSS (getrusage), which Linux carries across execve:
    # a harness started straight from this pytest process would start at pytest's own peak
    # (gigabytes once a real model has been loaded) and report out-of-memory on its first
    # check. A small launcher process in between gives the harness a fresh peak of its own.
    launcher = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", launcher, sys.executable, "-c", script, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )


def test_decoder_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    res = _fuzz(tmp_path)
    out = res.stdout + res.stderr
    crashes = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    assert res.returncode == 0 and not crashes, f"crash inputs {crashes}:\n{out[-6000:]}"
    assert f"Done {RUNS} runs" in out, out[-3000:]


BROKEN = {
    # anything but a KVCloudError escaping the decoder
    "stray exception": (
        "def broken(reader, out, **kw):\n"
        "    if len(reader.read()) > 8: raise IndexError('stray')\n",
        "IndexError: stray",
    ),
    # a hostile length trusted: far more memory than the input and one segment
    "unbounded allocation": (
        "import numpy as np\n"
        "def broken(reader, out, **kw):\n"
        "    if len(reader.read()) > 8: np.ones(64 << 20, dtype=np.uint8)\n",
        "MemoryError: decoding",
    ),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_the_harness_catches_a_broken_decoder(tmp_path: Path, what: str) -> None:
    """The check above can fail: a decoder that raises anything but KVCloudError, or
    allocates without bound, is reported as a crash and its input saved."""
    broken, expected = BROKEN[what]
    code = (
        "import sys, tests.security.fuzz_segment as f\n"
        f"{broken}"
        "f.segment.read_segment_into = broken\n"
        "f.main(sys.argv[1:])\n"
    )
    res = _fuzz(tmp_path, code=code)
    assert res.returncode != 0
    assert expected in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    assert any((tmp_path / "artifacts").iterdir())
