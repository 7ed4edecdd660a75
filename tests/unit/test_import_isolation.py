"""kvcloud works on numpy arrays: importing it, or its framework integrations, must not load
torch or transformers (a store/index client should not pay for, or require, either)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm")

CHECK = """
import sys
{imports}
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & {heavy!r})
print(",".join(loaded))
"""


def loaded_after(*modules: str) -> list[str]:
    code = CHECK.format(imports="\n".join(f"import {m}" for m in modules), heavy=set(HEAVY))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return [m for m in proc.stdout.strip().split(",") if m]


@pytest.mark.parametrize(
    "modules",
    [
        ("kvcloud", "kvcloud.integrations"),
        ("kvcloud.integrations.transformers",),
        # the vLLM connector's package, settings and namespace helpers: vLLM is imported only
        # when vLLM itself asks for the KVCloudConnector class
        ("kvcloud.integrations.vllm", "kvcloud.integrations.vllm.config"),
        ("kvcloud.integrations.vllm.keys",),
        # the command line, ``kvcloud size`` included (it reads the connector's settings,
        # shards and uploader, never its torch side)
        ("kvcloud.tools.cli", "kvcloud.tools.sizing"),
    ],
)
def test_kvcloud_imports_no_torch_or_transformers(modules: tuple[str, ...]) -> None:
    assert loaded_after(*modules) == []


def test_the_check_sees_a_heavy_import() -> None:
    """The check above can fail: it does report torch when something imports it."""
    pytest.importorskip("torch")
    assert loaded_after("kvcloud", "torch") == ["torch"]


def test_backends_sit_below_the_configuration() -> None:
    """``config`` chooses stores and indexes; they must not import it back (a cycle that made
    every backend drag in the whole configuration). Their URL helpers live in ``urls``."""
    import ast
    from pathlib import Path

    import kvcloud

    root = Path(kvcloud.__file__).parent
    offenders = []
    for path in [*root.glob("stores/*.py"), *root.glob("indexes/*.py"), root / "urls.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                if target.lstrip(".") == "config" or target.endswith("kvcloud.config"):
                    offenders.append(f"{path.relative_to(root)}: from {target} import …")
    assert offenders == []
    assert not (root / "netem.py").exists()  # a benchmark tool, not the library


def test_the_engine_never_imports_the_http_layer() -> None:
    """``workers.http`` drives the engine; no module outside it imports it but the worker's
    configuration (API keys) and command line (which starts the server)."""
    import ast
    from pathlib import Path

    import workers

    root = Path(workers.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] == "http" or rel.name in ("config.py", "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = ("." * node.level) + (node.module or "")
                if name.lstrip(".").startswith("http") or "workers.http" in name:
                    offenders.append(f"{rel}: from {name}")
    assert offenders == []
