"""A model with sliding-window layers beside full ones, served with vLLM's hybrid KV cache
allocator on (the connector is ``SupportsHMA``): two KV cache groups, the sliding one's
blocks behind its window handed back to vLLM's pool.

The model is a seeded random tiny Llama whose even layers slide over 320 tokens and odd
layers attend to everything (``layer_types``, as Gemma 2/3 and gpt-oss; built at install
time by scripts/models/build_tiny_sliding.py), with SmolLM2's tokenizer. Two servers with the
connector share one store; a third, without it, is the reference: a prefix one server
stored, restored by the other (each group into its own blocks, the sliding group inside
its window only), gives the reference's greedy answer; so does a conversation whose
answer chunks were saved while decoding (the window moving on under them), and a restore
that fails (vLLM then recomputes the request whole, never a part of it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcloud import Namespace
from kvcloud.integrations.vllm.keys import checkpoint_digest
from scripts.fleet.vllm_fleet import (
    SLIDING,
    VLLMServer,
    cached_tokens,
    completion_ids,
    kvcloud_transfer_config,
)
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import assert_same_answer, corrupt_chunk, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
WINDOW = 320


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("hybrid"), "vllm-hybrid-secret")


@pytest.fixture(scope="module")
def servers(store: dict[str, str], vllm_logs: Path) -> Iterator[dict[str, VLLMServer]]:
    if not (SLIDING / "config.json").is_file():
        pytest.fail(f"{SLIDING} missing: run make install-vllm")
    cfg = kvcloud_transfer_config()
    yield from serving(
        VLLMServer("HA", vllm_logs / "HA.log", model=SLIDING, transfer=cfg, env=store),
        VLLMServer("HB", vllm_logs / "HB.log", model=SLIDING, transfer=cfg, env=store),
        VLLMServer("HR", vllm_logs / "HR.log", model=SLIDING, in_process=True),
    )


def sliding_namespace() -> Namespace:
    """What both servers derive: every layer of the model, whatever group it is in."""
    return Namespace(
        model="vllm/llama", num_layers=4, num_kv_heads=2, head_dim=64,
        revision=checkpoint_digest(str(SLIDING)), dtype="float32", chunk_tokens=CHUNK,
        extra=json.dumps(
            {"compute_dtype": "float32", "layout": "vllm-kv-v1", "quantization": "None"},
            sort_keys=True,
        ),
    )  # fmt: skip


def test_the_hybrid_allocator_stays_on_with_two_groups(servers: dict[str, VLLMServer]) -> None:
    log = servers["HA"].log_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 KV cache groups (sliding 320, full)" in log
    assert sliding_namespace().id in log


def test_a_prefix_restores_every_group_across_servers(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    a, b, ref = servers["HA"], servers["HB"], servers["HR"]
    prompt = prompt_tokens(4 * CHUNK + 40, seed=41)
    a.complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 4 * CHUNK], ns=sliding_namespace()) == 4
    asked = [*prompt, 7, 8, 9]
    before = b.metrics()
    got = b.complete(asked, max_tokens=24)
    after = b.metrics()
    # every stored chunk restored: the full group's blocks of all 1,024 tokens, the sliding
    # group's inside the window at token 1,024 only (vLLM's null block behind it)
    assert after.get("loaded_tokens", 0) - before.get("loaded_tokens", 0) == 4 * CHUNK
    assert cached_tokens(got) == 4 * CHUNK
    assert_same_answer(got, ref.complete(asked, max_tokens=24), "HB, restored in two groups")
    assert after.get("restores_failed_whole", 0) == before.get("restores_failed_whole", 0)


def test_answer_chunks_saved_while_the_window_moves_restore_elsewhere(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    """A turn whose answer fills two more chunks while decoding (each copied in the step
    that completes it, its blocks still inside the 320-token window): the next turn, on the
    other server, restores the prompt's chunks and the answer's."""
    a, b, ref = servers["HA"], servers["HB"], servers["HR"]
    prompt = prompt_tokens(2 * CHUNK + 100, seed=42)
    first = a.complete(prompt, max_tokens=2 * CHUNK + 20, ignore_eos=True)
    history = [*prompt, *completion_ids(first)]
    full = len(history) // CHUNK
    assert full >= 3
    assert wait_stored(store, history[: full * CHUNK], ns=sliding_namespace()) == full
    turn = [*history, 11, 12, 13]
    before = b.metrics().get("loaded_tokens", 0)
    got = b.complete(turn, max_tokens=16)
    assert b.metrics().get("loaded_tokens", 0) - before == full * CHUNK
    assert_same_answer(got, ref.complete(turn, max_tokens=16), "HB, a turn moved after decode")


def test_a_failed_restore_recomputes_the_whole_request(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    """A chunk's object corrupted in the store: vLLM hears the request's restore failed
    (block ids would make it raise with two groups), recomputes it, answers as the
    reference, and keeps serving."""
    a, b, ref = servers["HA"], servers["HB"], servers["HR"]
    ns = sliding_namespace()
    prompt = prompt_tokens(3 * CHUNK + 30, seed=43)
    a.complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt[: 3 * CHUNK], ns=ns) == 3
    corrupt_chunk(store, ns, prompt[: 3 * CHUNK], 1)
    before = b.metrics()
    asked = [*prompt, 5, 6]
    got = b.complete(asked, max_tokens=16)
    after = b.metrics()
    assert after.get("restores_failed_whole", 0) - before.get("restores_failed_whole", 0) == 1
    assert after.get("verify_failures", 0) > before.get("verify_failures", 0)
    assert_same_answer(got, ref.complete(asked, max_tokens=16), "HB, after a failed restore")
    # still serving, and what it recomputed was saved again: another server restores it
    again = [*prompt, 9]
    got = a.complete(again, max_tokens=8)
    assert_same_answer(got, ref.complete(again, max_tokens=8), "HA, after HB's failure")
