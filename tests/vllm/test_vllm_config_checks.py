"""The connector against vLLM's own classes, no model and no server: vLLM's Phi-3 LongRoPE
and ``ModelConfig`` (the rope in the namespace), the connector's answers to vLLM 0.33's
sleep-mode hooks, its vLLM version check at start, and vLLM's ``CUDAGraphMode`` values as
the worker side reads them. The suite's venv has no vLLM: scripts/checks/vllm_config_checks.py runs
every check in one ``.venv-vllm`` process (vLLM's import is most of the time) and reports
what it saw; the asserts are here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from scripts.fleet.vllm_fleet import ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SCRIPT = ROOT / "scripts" / "checks" / "vllm_config_checks.py"
SLEEP_REFUSED = "does not support vLLM sleep mode"


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    """Every check's report, by name, from one run of the script; ``_proc`` is the run."""
    # this checkout's kvcloud, whatever the vLLM venv has installed
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=580,
    )
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith('{"check": ')]
    reports: dict[str, Any] = {line["check"]: line for line in lines}
    assert "env" in reports, f"rc={proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    kvcloud = reports["env"]["kvcloud"]
    assert Path(kvcloud).resolve().is_relative_to(ROOT.resolve()), kvcloud
    reports["_proc"] = proc
    return reports


def result(checks: dict[str, Any], name: str) -> dict[str, Any]:
    """A check's result, or the test fails with what the script said instead."""
    report = checks.get(name)
    if report is None:
        proc = checks["_proc"]
        pytest.fail(f"no report from check {name!r} (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    if "error" in report:
        pytest.fail(f"check {name!r} raised in vLLM's venv:\n{report['error']}")
    print(json.dumps(report["result"]))
    return report["result"]


def raised_connector_error(outcome: dict[str, Any], pattern: str) -> bool:
    return (
        bool(outcome.get("connector_error")) and re.search(pattern, outcome["message"]) is not None
    )


def test_vllm_longrope_rotates_by_max_model_len_and_the_namespace_follows(
    checks: dict[str, Any],
) -> None:
    """Against vLLM itself: its Phi-3 LongRoPE gives other post-RoPE K for the same tokens at
    a max_model_len above original_max_position_embeddings than at one below (the defect),
    the same K on one side; and namespaces built from vLLM's own ModelConfig follow."""
    got = result(checks, "longrope")
    assert got["same_k"] == {"4096=8192": False, "8192=16384": True}
    namespaces = got["namespaces"]
    assert set(namespaces) == {"phi3:4096", "phi3:8192", "phi3:16384", "llama:1024", "llama:4096"}
    for key, ns in namespaces.items():
        assert ns["rope_in_extra"] == key.startswith("phi3:"), (key, ns["extra"])
    ids = {key: ns["id"] for key, ns in namespaces.items()}
    assert ids["phi3:4096"] != ids["phi3:8192"] == ids["phi3:16384"]
    assert ids["llama:1024"] == ids["llama:4096"]


def test_the_connector_answers_vllm_033_sleep_hooks(checks: dict[str, Any]) -> None:
    """On vLLM 0.33 the base asks supports_sleep_mode (a classmethod given the config): no.
    A vLLM that calls release anyway is stopped before it unmaps the KV cache; restore has
    nothing to do. On 0.32 (no such hooks in the base) the methods exist and are not called."""
    got = result(checks, "sleep_hooks")
    assert got["supports_sleep_mode(config)"] == {"returned": "False"}
    assert got["supports_sleep_mode()"] == {"returned": "False"}
    for hook in ("release_kv_caches", "unregister_kv_caches"):
        assert raised_connector_error(got[hook], SLEEP_REFUSED), (hook, got[hook])
    assert got["restore_kv_caches"] == {"returned": "None"}


def test_the_connector_checks_the_vllm_version_at_start(checks: dict[str, Any]) -> None:
    """A setting that stops the start right after the version check: the check ran first."""
    got = result(checks, "version_check")
    assert raised_connector_error(got["start"], "not a multiple of vLLM's block size"), got
    assert got["seen"] == ["checked"]


def test_full_cuda_graphs_are_read_from_vllms_compilation_config(checks: dict[str, Any]) -> None:
    """vLLM's own CUDAGraphMode values: the full-graph modes make the worker side complete
    restores in the step before the pass (the model not run eagerly)."""
    got = result(checks, "cudagraph_modes")["full_graphs"]
    for mode, want in [
        ("FULL_AND_PIECEWISE", True),
        ("FULL_DECODE_ONLY", True),
        ("FULL", True),
        ("PIECEWISE", False),
        ("NONE", False),
    ]:
        assert got.get(mode) == want, (mode, got)
