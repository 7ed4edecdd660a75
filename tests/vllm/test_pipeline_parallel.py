"""Pipeline parallelism on real vLLM servers: a PP-2 vLLM (each stage holding two of the tiny
Llama's four layers) and a TP-1 vLLM share prefixes in both directions, each answer equal to
a vLLM without the connector of the same shape.

A chunk the PP-2 vLLM saves is a grid of two parts, one per stage's layers, registered by the
stage whose part is stored last; the TP-1 vLLM reads both; each stage of the PP-2 vLLM reads
its layers of the whole chunks the TP-1 vLLM stored. vLLM 0.32's CPU backend serves PP only
in its compiled mode (with ``--enforce-eager`` its second stage fails the first request), so
the PP-2 servers run without it (``eager=False``); both bind one OpenMP thread per stage to
each core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fleet.vllm_fleet import VLLMServer, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import objects_per_chunk, restore_and_compare, wait_stored
from tests.vllm.test_tensor_parallel import CHUNK, TP2, tiny_namespace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.models.build_tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("pp"), "vllm-pp-secret")


@pytest.fixture(scope="module")
def servers(tiny: Path, store: dict[str, str], vllm_logs: Path) -> Iterator[dict[str, VLLMServer]]:
    cfg = kvcloud_transfer_config()
    pp = ["--pipeline-parallel-size", "2"]
    p2_env = {**store, **TP2}
    yield from serving(
        VLLMServer("T1", vllm_logs / "PT1.log", model=tiny, transfer=cfg, env=store),
        VLLMServer(
            "P2", vllm_logs / "P2.log", model=tiny, transfer=cfg, env=p2_env, args=pp, eager=False
        ),
        VLLMServer("R1", vllm_logs / "PR1.log", model=tiny, in_process=True),
        VLLMServer("RP2", vllm_logs / "RP2.log", model=tiny, env=TP2, args=pp, eager=False),
    )


def test_pp2_prefix_restores_into_tp1(
    servers: dict[str, VLLMServer], store: dict[str, str], tiny: Path
) -> None:
    ns = tiny_namespace(tiny)
    prompt = prompt_tokens(4 * CHUNK + 40, seed=41)
    servers["P2"].complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 4 * CHUNK], ns=ns) == 4
    # stored as a grid: each entry names two objects, one per stage's layers
    assert objects_per_chunk(store, ns, prompt[: 4 * CHUNK]) == [2, 2, 2, 2]
    restore_and_compare(servers["T1"], servers["R1"], [*prompt, 7, 8, 9], 3 * CHUNK, "pp2->tp1")


def test_tp1_prefix_restores_into_pp2(
    servers: dict[str, VLLMServer], store: dict[str, str], tiny: Path
) -> None:
    ns = tiny_namespace(tiny)
    prompt = prompt_tokens(4 * CHUNK + 40, seed=42)
    servers["T1"].complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 4 * CHUNK], ns=ns) == 4
    asked = [*prompt, 7, 8, 9]
    # each stage restores its layers of every chunk (vLLM sums both stages' counters)
    restore_and_compare(servers["P2"], servers["RP2"], asked, 3 * CHUNK, "tp1->pp2")
    # the next turn on the PP-2 vLLM stores its new chunk as a grid over the TP-1 vLLM's
    # whole ones; back on the TP-1 vLLM the new chunk comes from that grid
    follow = [*asked, *prompt_tokens(CHUNK, seed=43)]
    servers["P2"].complete(follow, max_tokens=2)
    assert wait_stored(store, follow[: 5 * CHUNK], ns=ns) == 5
    assert objects_per_chunk(store, ns, follow[: 5 * CHUNK]) == [1, 1, 1, 1, 2]
    restore_and_compare(servers["T1"], servers["R1"], [*follow, 4], CHUNK, "pp2->tp1 turn")
