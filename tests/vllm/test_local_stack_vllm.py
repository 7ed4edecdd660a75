"""``infra/local/start.sh --vllm``: the no-docker fleet on one machine, with real servers
(SeaweedFS as S3, redis-server as the index) and two vLLMs with the connector. A prompt the
first vLLM answered is restored by the second, which answers like a vLLM without the
connector; stop.sh stops everything (the vLLMs before the store they flush to)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.vllm_fleet import ROOT, VLLMServer
from tests.servers import free_port
from tests.vllm.conftest import prompt_tokens
from tests.vllm.helpers import restore_and_compare, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

START = ROOT / "infra" / "local" / "start.sh"
STOP = ROOT / "infra" / "local" / "stop.sh"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not any(line.startswith("State:") and "Z" in line for line in status.splitlines())


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], dict[str, int], Path]]:
    state = tmp_path_factory.mktemp("local-fleet") / "state"
    names = ("REDIS", "S3", "WORKER1", "WORKER2", "EXPORTER", "VLLM1", "VLLM2")
    ports = {name: free_port() for name in names}
    env = {
        **os.environ,
        "KVCLOUD_LOCAL_STATE": str(state),
        "KVCLOUD_LOCAL_VENV": str(Path(sys.executable).parent.parent),
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
            ["bash", str(START), "--vllm"], env=env, capture_output=True, text=True, timeout=700
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"vLLM 2    http://127.0.0.1:{ports['VLLM2']}" in started.stdout
        yield env, ports, state
    finally:
        subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=300)


def test_second_vllm_restores_what_the_first_computed(
    fleet: tuple[dict[str, str], dict[str, int], Path], reference: VLLMServer
) -> None:
    env, ports, state = fleet
    exports = {}
    for line in (state / "env").read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = value.strip("'")
    one = VLLMServer("local-1", state / "logs" / "vllm1.log", port=ports["VLLM1"])
    two = VLLMServer("local-2", state / "logs" / "vllm2.log", port=ports["VLLM2"])
    for server in (one, two):
        log = server.log_text()
        assert "kvcloud" in log and "store s3://" in log and "index redis://" in log, log[-2000:]

    prompt = prompt_tokens(1100, seed=77)
    one.complete(prompt, max_tokens=4)
    # pushed through SeaweedFS and registered in Redis, read back by a plain lookup
    assert wait_stored(exports, prompt) == 4
    restore_and_compare(two, reference, prompt, 1024, "local stack: vLLM 2 restores vLLM 1's")

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
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in pids.items() if _alive(pid)]
