"""The built package, not the checkout: ``python -m build`` makes an sdist and a wheel (the
wheel built from the sdist, so both are complete), the wheel goes into a fresh virtualenv
with no source tree on its path, and a real vLLM started from that virtualenv, in a folder
outside the repository, loads the connector from the wheel and answers a restored prefix
like a vLLM without the connector.

The fresh virtualenv sees vLLM, torch and the connector's dependencies through one path
entry: a folder of links to ``.venv-vllm``'s installed packages with kvcloud's own left out
(installing vLLM again would take minutes and a download). kvcloud itself comes only from
the wheel, which the test checks before vLLM starts.
"""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcloud
from kvcloud import KVCloud
from kvcloud.tools.sizing import FleetLoad, model_kv, read_config, size_fleet
from scripts.vllm_fleet import (
    ROOT,
    SMOLLM2,
    VLLM_PYTHON,
    VLLMServer,
    connector_namespace,
    kvcloud_transfer_config,
)
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import restore_and_compare, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# the entries of .venv-vllm's site-packages that are kvcloud's editable checkout: the
# fresh environment must not see them
CHECKOUT = ("kvcloud", "workers", "__editable__", "_kvcloud")


def run(*argv: str | Path, cwd: Path, timeout: float = 300) -> str:
    r = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    # no --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("kvcloud-*.whl")
    (sdist,) = out.glob("kvcloud-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_wheel_and_sdist_hold_the_package(dist: dict[str, Path]) -> None:
    modules = {
        str(p.relative_to(ROOT))
        for top in ("kvcloud", "workers")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(
            z.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        )
    assert modules <= names, f"wheel lacks {sorted(modules - names)[:5]}"
    assert "kvcloud/py.typed" in names
    assert not any(n.startswith(("tests/", "scripts/")) for n in names), "tests in the wheel"
    assert dist["wheel"].name == f"kvcloud-{kvcloud.__version__}-py3-none-any.whl"
    assert meta["Version"] == kvcloud.__version__
    # the connector's extra brings what it needs beside vLLM, never vLLM itself (whose pins
    # on torch and CUDA must win)
    assert "vllm" in meta.get_all("Provides-Extra")
    vllm_reqs = [r for r in meta.get_all("Requires-Dist") if 'extra == "vllm"' in r]
    assert {r.split(";")[0].split(">")[0].split("[")[0].strip() for r in vllm_reqs} == {
        "boto3",
        "redis",
    }, vllm_reqs
    with tarfile.open(dist["sdist"]) as t:
        top = f"kvcloud-{kvcloud.__version__}/"
        sdist_names = {n.removeprefix(top) for n in t.getnames()}
    assert modules <= sdist_names, f"sdist lacks {sorted(modules - sdist_names)[:5]}"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, dist: dict[str, Path]) -> Path:
    """A new virtualenv holding the wheel; vLLM's packages reach it through a path entry."""
    base = tmp_path_factory.mktemp("fresh")
    env = base / "env"
    run(sys.executable, "-m", "venv", "--without-pip", env, cwd=base)
    vllm_site = Path(
        run(
            VLLM_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=base
        ).strip()
    )
    links = base / "vllm-packages"
    links.mkdir()
    for entry in vllm_site.iterdir():
        if not entry.name.startswith(CHECKOUT) and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    site = Path(
        run(
            env / "bin" / "python",
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
            cwd=base,
        ).strip()
    )
    (site / "vllm-packages.pth").write_text(f"{links}\n")
    # --no-index: the [vllm] extra's requirements must already be met by what vLLM's
    # environment holds (pip looks at the fresh interpreter's path, links included)
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        env / "bin" / "python",
        "install",
        "--quiet",
        "--no-index",
        f"{dist['wheel']}[vllm]",
        cwd=base,
    )
    return env


def test_fresh_environment_runs_kvcloud_from_the_wheel(fresh: Path) -> None:
    where = run(
        fresh / "bin" / "python",
        "-c",
        "import kvcloud, kvcloud.integrations.vllm.connector as c; print(kvcloud.__file__); "
        "print(c.__file__)",
        cwd=fresh.parent,
    ).split()
    assert all(Path(p).is_relative_to(fresh) for p in where), where
    assert not any(Path(p).is_relative_to(ROOT) for p in where), where
    out = run(fresh / "bin" / "kvcloud", "--version", cwd=fresh.parent)
    assert out.strip() == f"kvcloud {kvcloud.__version__}"


@pytest.fixture(scope="module")
def installed(
    fresh: Path, tmp_path_factory: pytest.TempPathFactory, vllm_logs: Path
) -> Iterator[tuple[VLLMServer, dict[str, str]]]:
    store = embedded_env(tmp_path_factory.mktemp("package-store"), "package-test-secret")
    server = VLLMServer(
        "W",
        vllm_logs / "W.log",
        transfer=kvcloud_transfer_config(),
        # no PYTHONPATH from the test run: only the fresh environment's own path
        env={**store, "PYTHONPATH": ""},
        # vLLM's prefix cache off: the second ask can only skip its prefill by a restore
        args=["--no-enable-prefix-caching"],
        python=fresh / "bin" / "python",
        cwd=fresh.parent,
    )
    for s in serving(server):
        yield s["W"], store


def test_vllm_from_the_wheel_restores_like_no_connector(
    installed: tuple[VLLMServer, dict[str, str]], fresh: Path, reference: VLLMServer
) -> None:
    server, store = installed
    start_line = next(
        line for line in server.log_text().splitlines() if "connector (worker)" in line
    )
    assert f"kvcloud {kvcloud.__version__} connector" in start_line, start_line
    prompt = prompt_tokens(1100, seed=42)
    server.complete(prompt, max_tokens=4)
    assert wait_stored(store, prompt) == 4
    # each object is the size `kvcloud size` says a chunk of this model takes
    want = size_fleet(
        model_kv(read_config(SMOLLM2), dtype="float32"),
        FleetLoad(requests_per_s=1.0, prompt_tokens=256),
    )["objects"]["bytes"]
    root = Path(store["KVCLOUD_STORE"].removeprefix("file://"))
    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as k:
        chunks = k.lookup(connector_namespace(), prompt).chunks
        sizes = [[(root / key).stat().st_size for key in c.entry.keys] for c in chunks]
    assert sizes == [want] * 4, (sizes, want)
    restore_and_compare(server, reference, prompt, 1024, "vLLM with kvcloud from the wheel")
