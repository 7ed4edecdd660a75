"""Tensor parallelism on real vLLM servers: a TP-2 vLLM and a TP-1 vLLM share prefixes in both
directions, each answer equal to a vLLM without the connector at the same TP size.

SmolLM2's 9 attention heads cannot be split in two, so these servers serve a seeded random
tiny Llama (4 attention heads over 2 KV heads, 4 layers, SmolLM2's tokenizer;
scripts/models/build_tiny_llama.py). The TP-2 servers bind one OpenMP thread per rank to each core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``, which vLLM's CPU backend needs for TP > 1). A chunk the
TP-2 vLLM saves is stored as two parts, one per rank's KV head, registered by its scheduler
once both are in; the TP-1 vLLM reads both; the TP-2 vLLM reads its heads of the whole chunks
the TP-1 vLLM stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcloud import Namespace
from kvcloud.integrations.vllm.keys import checkpoint_digest
from scripts.fleet.vllm_fleet import VLLMServer, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import objects_per_chunk, restore_and_compare, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.models.build_tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("tp"), "vllm-tp-secret")


@pytest.fixture(scope="module")
def servers(tiny: Path, store: dict[str, str], vllm_logs: Path) -> Iterator[dict[str, VLLMServer]]:
    cfg = kvcloud_transfer_config()
    tp = ["--tensor-parallel-size", "2"]
    t2_env = {**store, **TP2}
    yield from serving(
        VLLMServer("T1", vllm_logs / "T1.log", model=tiny, transfer=cfg, env=store),
        VLLMServer("T2", vllm_logs / "T2.log", model=tiny, transfer=cfg, env=t2_env, args=tp),
        VLLMServer("R1", vllm_logs / "R1.log", model=tiny, in_process=True),
        VLLMServer("R2", vllm_logs / "R2.log", model=tiny, env=TP2, args=tp),
    )


def tiny_namespace(tiny: Path) -> Namespace:
    """The namespace both servers derive (the whole model's 2 KV heads at either TP size)."""
    return Namespace(
        model="vllm/llama", num_layers=4, num_kv_heads=2, head_dim=64,
        revision=checkpoint_digest(str(tiny)), dtype="float32", chunk_tokens=CHUNK,
        extra=json.dumps(
            {"compute_dtype": "float32", "layout": "vllm-kv-v1", "quantization": "None"},
            sort_keys=True,
        ),
    )  # fmt: skip


def test_tp2_prefix_restores_into_tp1(
    servers: dict[str, VLLMServer], store: dict[str, str], tiny: Path
) -> None:
    ns = tiny_namespace(tiny)
    prompt = prompt_tokens(4 * CHUNK + 40, seed=31)
    servers["T2"].complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 4 * CHUNK], ns=ns) == 4
    # stored as parts: each entry names two objects, one per rank's KV head
    assert objects_per_chunk(store, ns, prompt[: 4 * CHUNK]) == [2, 2, 2, 2]
    restore_and_compare(servers["T1"], servers["R1"], [*prompt, 7, 8, 9], 3 * CHUNK, "tp2->tp1")


def test_tp1_prefix_restores_into_tp2(
    servers: dict[str, VLLMServer], store: dict[str, str], tiny: Path
) -> None:
    ns = tiny_namespace(tiny)
    prompt = prompt_tokens(4 * CHUNK + 40, seed=32)
    servers["T1"].complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 4 * CHUNK], ns=ns) == 4
    asked = [*prompt, 7, 8, 9]
    # every rank restores its head of every chunk (vLLM sums both ranks' counters)
    restore_and_compare(servers["T2"], servers["R2"], asked, 3 * CHUNK, "tp1->tp2")
    # the next turn on the TP-2 vLLM stores its new chunk as parts over the TP-1 vLLM's
    # whole ones; back on the TP-1 vLLM (its own cache holds the first 1,024 tokens) the
    # new chunk comes from those parts
    follow = [*asked, *prompt_tokens(CHUNK, seed=33)]
    servers["T2"].complete(follow, max_tokens=2)
    assert wait_stored(store, follow[: 5 * CHUNK], ns=ns) == 5
    restore_and_compare(servers["T1"], servers["R1"], [*follow, 4], CHUNK, "tp2->tp1 turn")
