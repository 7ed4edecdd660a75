"""Settings that change the KV bytes for the same weights and tokens, on real vLLM servers:
``--hf-overrides`` that turn SmolLM2's layers into sliding-window attention.

- the overrides are part of the namespace: a plain SmolLM2 never restores what the
  sliding-window one pushed (and answers like a vLLM without the connector);
- a sliding-window restore skips vLLM's null block (the blocks out of the window) and
  answers like a vLLM without the connector with the same overrides;
- a sliding-window restore that fails is recomputed whole (vLLM's hybrid allocator is on:
  one KV cache group, all of it sliding), and answers like that vLLM too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcloud import Namespace
from scripts.fleet.vllm_fleet import VLLMServer, cached_tokens, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import (
    assert_same_answer,
    connector_namespace,
    corrupt_chunk,
    wait_stored,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
WINDOW = 512
OVERRIDES = {"layer_types": ["sliding_attention"] * 30, "sliding_window": WINDOW}
SW_ARGS = ["--hf-overrides", json.dumps(OVERRIDES)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("overrides"), "vllm-overrides-secret")


@pytest.fixture(scope="module")
def servers(
    store: dict[str, str], vllm_logs: Path, reference: VLLMServer
) -> Iterator[dict[str, VLLMServer]]:
    cfg = kvcloud_transfer_config()
    sw = VLLMServer(
        "SW",
        vllm_logs / "SW.log",
        transfer=cfg,
        env={**store, "VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
        args=SW_ARGS,
    )
    plain = VLLMServer("PL", vllm_logs / "PL.log", transfer=cfg, env=store)
    swr = VLLMServer("SWR", vllm_logs / "SWR.log", args=SW_ARGS, in_process=True)
    yield from serving(sw, plain, swr)


def sliding_namespace() -> Namespace:
    """The namespace the connector must derive for the overridden model, built here from
    its definition (compared with the id the server logs)."""
    plain = connector_namespace()
    extra = json.loads(plain.extra)
    extra["hf_overrides"] = json.dumps(OVERRIDES, sort_keys=True, default=str)
    return Namespace(
        model=plain.model,
        num_layers=plain.num_layers,
        num_kv_heads=plain.num_kv_heads,
        head_dim=plain.head_dim,
        revision=plain.revision,
        dtype=plain.dtype,
        chunk_tokens=plain.chunk_tokens,
        extra=json.dumps(extra, sort_keys=True),
    )


def test_overrides_are_in_the_namespace(
    servers: dict[str, VLLMServer], store: dict[str, str], reference: VLLMServer
) -> None:
    sw, plain = servers["SW"], servers["PL"]
    ns = sliding_namespace()
    logged = re.findall(r"namespace ([0-9a-f]{32})", sw.log_text())[-1]
    assert logged == ns.id != connector_namespace().id
    prompt = prompt_tokens(1100, seed=500)
    sw.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt, ns=ns) == 4
    # SW's pushes for this prompt are all in: none went under the plain namespace
    assert wait_stored(store, prompt, timeout=0, want=1) == 0
    turn = [*prompt, 5, 6, 7]
    got = plain.complete(turn, max_tokens=16)
    assert cached_tokens(got) == 0  # nothing of the sliding-window model's KV
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "plain after sliding")


def test_a_sliding_window_restore_answers_like_no_connector(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    sw, swr = servers["SW"], servers["SWR"]
    prompt = prompt_tokens(1400, seed=501)  # 5 full chunks, the first ones out of the window
    sw.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt, ns=sliding_namespace()) == 5
    httpx.post(sw.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    before = sw.metrics()
    turn = [*prompt, *prompt_tokens(30, seed=502)]
    got = sw.complete(turn, max_tokens=16)
    after = sw.metrics()
    assert cached_tokens(got) >= 5 * CHUNK
    assert after.get("loaded_tokens", 0) > before.get("loaded_tokens", 0)
    assert after.get("load_failed_blocks", 0) == before.get("load_failed_blocks", 0)
    assert_same_answer(got, swr.complete(turn, max_tokens=16), "sliding window, restored")


def test_a_failed_sliding_window_restore_recomputes_the_whole_request(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    """The last chunk of a restore is corrupt. vLLM put its null block behind the window of
    the restore point (tokens before 1,280 - 512), so a recompute from that chunk's first
    block would attend over null blocks inside its own window: the restore is reported
    failed as a whole request, recomputed from its first token, and answers right."""
    sw, swr = servers["SW"], servers["SWR"]
    ns = sliding_namespace()
    prompt = prompt_tokens(1400, seed=503)
    sw.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt, ns=ns) == 5
    corrupt_chunk(store, ns, prompt[: 5 * CHUNK], 4)
    httpx.post(sw.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    before = sw.metrics()
    turn = [*prompt, *prompt_tokens(30, seed=504)]
    got = sw.complete(turn, max_tokens=16)
    after = sw.metrics()
    assert after.get("restores_failed_whole", 0) - before.get("restores_failed_whole", 0) == 1
    assert after.get("load_failed_blocks", 0) > before.get("load_failed_blocks", 0)
    assert_same_answer(got, swr.complete(turn, max_tokens=16), "sliding window, failed restore")
