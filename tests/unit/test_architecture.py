"""The shape of the code: no import circle, no module over ~600 lines, and the module map in
docs/ARCHITECTURE.md generated from the tree as it is (scripts/reports/architecture.py)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


@pytest.fixture(scope="module")
def arch():
    spec = importlib.util.spec_from_file_location(
        "architecture", ROOT / "scripts/reports/architecture.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_circle(arch) -> None:
    """Neither at import time nor through imports inside functions (two modules that import
    each other are one module split in two files)."""
    mods = arch.modules()
    assert mods  # the walk found the packages
    assert arch.import_cycles(mods, lazy=True) == []


def test_the_circle_check_sees_a_circle(arch) -> None:
    """The check above can fail: a two-module circle, a lazy one, and one through a package's
    ``__init__`` are each found."""
    M = arch.Module

    def mod(name: str, top=(), lazy=(), init=False) -> tuple[str, object]:
        path = Path(name.replace(".", "/")) / "__init__.py" if init else Path(f"{name}.py")
        return name, M(name, path, 1, "", frozenset(top), frozenset(lazy))

    plain = dict([mod("kvcloud.a", top=["kvcloud.b"]), mod("kvcloud.b", top=["kvcloud.a"])])
    assert arch.import_cycles(plain) == [["kvcloud.a", "kvcloud.b", "kvcloud.a"]]
    lazy = dict([mod("kvcloud.a", top=["kvcloud.b"]), mod("kvcloud.b", lazy=["kvcloud.a"])])
    assert arch.import_cycles(lazy) == []
    assert arch.import_cycles(lazy, lazy=True) == [["kvcloud.a", "kvcloud.b", "kvcloud.a"]]
    # kvcloud.p.x imports kvcloud.q, whose module imports kvcloud.p.y: importing kvcloud.p.y
    # runs kvcloud.p's __init__, which imports kvcloud.p.x
    via_init = dict(
        [
            mod("kvcloud.p", top=["kvcloud.p.x"], init=True),
            mod("kvcloud.p.x", top=["kvcloud.q"]),
            mod("kvcloud.p.y"),
            mod("kvcloud.q", top=["kvcloud.p.y"]),
        ]
    )
    assert arch.import_cycles(via_init)
    # a package's __init__ importing its own modules is not a circle
    own = dict([mod("kvcloud.p", top=["kvcloud.p.x"], init=True), mod("kvcloud.p.x")])
    assert arch.import_cycles(own) == []


def test_an_import_for_type_checking_only_ties_two_modules_too(arch) -> None:
    """``if TYPE_CHECKING: from .s3 import S3Store`` in a module s3.py imports is a circle
    (the one kvcloud.stores.s3_stream had): not run at import time, so it counts where
    the imports inside functions do."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .base import Buffer\n"
        "if TYPE_CHECKING:\n"
        "    from .s3 import S3Store\n"
        "def f():\n"
        "    from ..errors import StoreError\n"
    )
    top, lazy = arch._imports(ast.parse(source), "kvcloud.stores.s3_stream", False)
    assert "kvcloud.stores.base" in top and "kvcloud.stores.s3" not in top
    assert {"kvcloud.stores.s3", "kvcloud.errors"} <= lazy


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imports(mods, where, package: str) -> list[str]:
    """Imports (at the top or inside a function) of a module under ``package`` by the
    modules whose name ``where`` accepts."""
    return sorted(
        f"{m.name} -> {dep}"
        for m in mods.values()
        if where(m.name)
        for dep in m.imports | m.lazy
        if _under(dep, package)
    )


def test_the_core_never_imports_its_tools_or_integrations(arch) -> None:
    """The data path reads on its own: the operator tools and the engine integrations sit on
    top of it, and kvcloud never reaches into its own worker."""
    mods = arch.modules()

    def core(name: str) -> bool:
        return (
            _under(name, "kvcloud")
            and name != "kvcloud"
            and not _under(name, "kvcloud.tools")
            and not _under(name, "kvcloud.integrations")
        )

    assert any(core(name) for name in mods)
    for package in ("kvcloud.tools", "kvcloud.integrations", "workers"):
        assert _imports(mods, core, package) == []
    assert _imports(mods, lambda name: _under(name, "kvcloud"), "workers") == []
    # and the check sees an import when there is one
    assert _imports(mods, lambda name: _under(name, "kvcloud.tools"), "kvcloud.client")


def test_a_benchmark_imports_the_engine_never_the_reverse(arch) -> None:
    """``workers.bench`` drives the engine; outside it only ``kvcloud-worker``'s command line
    (the ``bench`` subcommands) imports it. (The engine and the HTTP layer:
    test_import_isolation.py.)"""
    mods = arch.modules()
    assert _imports(mods, lambda name: _under(name, "workers.engine"), "workers.bench") == []

    def outside(name: str) -> bool:
        return not _under(name, "workers.bench") and name != "workers.cli"

    assert _imports(mods, outside, "workers.bench") == []
    assert _imports(mods, lambda name: _under(name, "workers.bench"), "workers.engine")


def test_no_module_over_the_limit(arch) -> None:
    long = {m.name: m.lines for m in arch.modules().values() if m.lines > MAX_LINES}
    assert long == {}


def test_the_module_map_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/reports/architecture.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
