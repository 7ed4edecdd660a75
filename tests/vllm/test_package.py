"""The built package, not the checkout, and the fleet on one machine: ``python -m build``
makes an sdist and a wheel (the wheel built from the sdist, so both are complete), the wheel
goes into a fresh virtualenv with no source tree on its path, and ``infra/local/start.sh
--vllm`` runs two real vLLMs from that virtualenv, in a folder outside the repository, beside
real servers (SeaweedFS as S3, redis-server as the index): the second restores what the
first computed and answers like a vLLM without the connector.

The fresh virtualenv sees vLLM, torch and the connector's dependencies through one path
entry: a folder of links to ``.venv-vllm``'s installed packages with kvcloud's own left out
(installing vLLM again would take minutes and a download). kvcloud itself comes only from
the wheel, which the test checks before vLLM starts.
"""

from __future__ import annotations

import email
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

import kvcloud
from kvcloud import KVCloud
from kvcloud.stores import S3Config
from kvcloud.tools.sizing import FleetLoad, model_kv, read_config, size_fleet
from scripts.fleet.vllm_fleet import (
    ROOT,
    SMOLLM2,
    VLLM_PYTHON,
    VLLMServer,
    connector_namespace,
)
from tests.local_stack import alive, stack_exports
from tests.servers import free_port
from tests.vllm.conftest import prompt_tokens
from tests.vllm.helpers import restore_and_compare, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# the entries of .venv-vllm's site-packages that are kvcloud's editable checkout: the
# fresh environment must not see them
CHECKOUT = ("kvcloud", "workers", "__editable__", "_kvcloud")
START = ROOT / "infra" / "local" / "start.sh"
STOP = ROOT / "infra" / "local" / "stop.sh"


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
def fleet(
    fresh: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], dict[str, int], Path]]:
    """``infra/local/start.sh --vllm`` with its two vLLMs run by the fresh environment's
    Python, in a folder outside the repository: the no-docker fleet on real servers
    (SeaweedFS as S3, redis-server as the index) with kvcloud from the wheel."""
    state = tmp_path_factory.mktemp("local-fleet") / "state"
    names = ("REDIS", "S3", "WORKER1", "WORKER2", "EXPORTER", "VLLM1", "VLLM2")
    ports = {name: free_port() for name in names}
    env = {
        **os.environ,
        # no PYTHONPATH from the test run: the vLLMs see only the fresh environment's path
        "PYTHONPATH": "",
        "KVCLOUD_LOCAL_STATE": str(state),
        "KVCLOUD_LOCAL_VENV": str(Path(sys.executable).parent.parent),
        "KVCLOUD_LOCAL_VLLM_VENV": str(fresh),
        "KVCLOUD_LOCAL_PROMETHEUS": "no",
        "KVCLOUD_LOCAL_STOP_TIMEOUT": "60",
        "KVCLOUD_WORKER_MODEL": "tiny",
        "KVCLOUD_LOCAL_VLLM_NAME": "smollm2",  # what VLLMServer.complete asks for
        **{f"KVCLOUD_LOCAL_{name}_PORT": str(port) for name, port in ports.items()},
    }
    for var in ("KVCLOUD_STORE", "KVCLOUD_INDEX", "KVCLOUD_SECRET", "AWS_ACCESS_KEY_ID"):
        env.pop(var, None)
    try:
        started = subprocess.run(
            ["bash", str(START), "--vllm"],
            env=env,
            cwd=fresh.parent,
            capture_output=True,
            text=True,
            timeout=700,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"vLLM 2    http://127.0.0.1:{ports['VLLM2']}" in started.stdout
        yield env, ports, state
    finally:
        subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=300)


def test_local_fleet_from_the_wheel_shares_kv_through_s3_and_redis(
    fleet: tuple[dict[str, str], dict[str, int], Path], reference: VLLMServer
) -> None:
    env, ports, state = fleet
    exports = stack_exports(state)
    one = VLLMServer("local-1", state / "logs" / "vllm1.log", port=ports["VLLM1"])
    two = VLLMServer("local-2", state / "logs" / "vllm2.log", port=ports["VLLM2"])
    for server in (one, two):
        start_line = next(
            line for line in server.log_text().splitlines() if "connector (worker)" in line
        )
        assert f"kvcloud {kvcloud.__version__} connector" in start_line, start_line
        assert "store s3://" in start_line and "index redis://" in start_line, start_line

    prompt = prompt_tokens(1100, seed=77)
    one.complete(prompt, max_tokens=4)
    # pushed through SeaweedFS and registered in Redis, read back by a plain lookup
    assert wait_stored(exports, prompt) == 4
    # each object, as a plain boto3 HEAD sees it, is the size `kvcloud size` gives a chunk
    want = size_fleet(
        model_kv(read_config(SMOLLM2), dtype="float32"),
        FleetLoad(requests_per_s=1.0, prompt_tokens=256),
    )["objects"]["bytes"]
    cfg = S3Config.from_url(exports["KVCLOUD_STORE"], env={})
    s3 = boto3.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
    )
    with KVCloud.open(
        store=exports["KVCLOUD_STORE"],
        index=exports["KVCLOUD_INDEX"],
        secret=exports["KVCLOUD_SECRET"],
    ) as k:
        chunks = k.lookup(connector_namespace(), prompt).chunks
    sizes = [
        [
            s3.head_object(Bucket=cfg.bucket, Key=f"{cfg.prefix}/{key}")["ContentLength"]
            for key in c.entry.keys
        ]
        for c in chunks
    ]
    assert sizes == [want] * 4, (sizes, want)
    # the other vLLM restores them and answers like a vLLM without the connector
    restore_and_compare(two, reference, prompt, 1024, "local fleet from the wheel: 2 restores 1's")

    pids = {p.stem: int(p.read_text()) for p in (state / "pids").glob("*.pid")}
    assert {"vllm1", "vllm2", "s3", "redis"} <= set(pids)
    stopped = subprocess.run(
        ["bash", str(STOP)], env=env, capture_output=True, text=True, timeout=300
    )
    assert stopped.returncode == 0, stopped.stderr
    # the vLLMs stop before the store they flush to
    order = [line.split()[1] for line in stopped.stdout.splitlines() if line.startswith("stopped")]
    assert max(order.index("vllm1"), order.index("vllm2")) < order.index("s3"), order
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in pids.items() if alive(pid)]
