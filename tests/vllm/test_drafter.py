"""Speculative decoding with an EAGLE drafter: its draft layer's KV (``model.layers.30``,
after SmolLM2's 30) is stored and restored with the target's, and checked against a vLLM
without the connector running the same drafter (scripts/models/build_tiny_eagle.py: an EAGLE head
made from SmolLM2's own weights, whose proposals vLLM accepts about a third of the time).

A restore must give the same greedy answer (the target's KV), and the same proposals: the
drafter attends over its own layer's KV, so a restore that left it out, or wrote another
prompt's, changes what it proposes and vLLM's acceptance counters
(``vllm:spec_decode_num_draft_tokens`` and ``..._accepted_tokens``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fleet.vllm_fleet import EAGLE, VLLMServer, cached_tokens, kvcloud_transfer_config
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import assert_same_answer, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SPEC = [
    "--speculative-config",
    json.dumps({"method": "eagle", "model": str(EAGLE), "num_speculative_tokens": 2}),
]
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counts(server: VLLMServer) -> dict[str, float]:
    samples = server._scrape()
    return {k: samples.get(f"vllm:spec_decode_{k}_total", 0.0) for k in SPEC_COUNTERS}


@pytest.fixture(scope="module")
def drafters(
    tmp_path_factory: pytest.TempPathFactory, vllm_logs: Path
) -> Iterator[dict[str, VLLMServer]]:
    if not (EAGLE / "config.json").is_file():
        pytest.fail(f"{EAGLE} missing: run make install-vllm")
    env = embedded_env(tmp_path_factory.mktemp("drafter"), "vllm-drafter-secret")
    cfg = kvcloud_transfer_config()
    yield from serving(
        VLLMServer("DA", vllm_logs / "DA.log", transfer=cfg, env=env, args=SPEC),
        VLLMServer("DB", vllm_logs / "DB.log", transfer=cfg, env=env, args=SPEC),
        # the reference: the same drafter, no connector
        VLLMServer("DR", vllm_logs / "DR.log", args=SPEC, in_process=True),
    )


def test_an_eagle_drafters_kv_is_restored_with_the_targets(
    drafters: dict[str, VLLMServer],
) -> None:
    a, b, ref = drafters["DA"], drafters["DB"], drafters["DR"]
    # a prompt whose answer repeats itself: the drafter's proposals are accepted often
    prompt = [*prompt_tokens(1200, seed=21), *([562] * 600)]
    a.complete(prompt, max_tokens=8)
    ns = drafter_namespace()
    assert ns.id in a.log_text()  # the namespace the server derived, rebuilt here
    assert wait_stored(_env(a), prompt, ns=ns) == len(prompt) // 256
    turn = [*prompt, *([562] * 20)]
    before_b, before_ref = spec_counts(b), spec_counts(ref)
    got = b.complete(turn, max_tokens=48)
    want = ref.complete(turn, max_tokens=48)
    # every stored chunk but the last one's last block (its draft KV depends on the token
    # after the chunk, which the chunk's key does not cover: recomputed, as vLLM does)
    assert cached_tokens(got) >= len(prompt) // 256 * 256 - 128
    assert b.metrics().get("loaded_tokens", 0) >= len(prompt) // 256 * 256 - 128
    assert_same_answer(got, want, "DB, restored with its drafter's KV")
    drafted = {k: spec_counts(b)[k] - before_b[k] for k in SPEC_COUNTERS}
    reference = {k: spec_counts(ref)[k] - before_ref[k] for k in SPEC_COUNTERS}
    print(f"restored: {drafted}; reference: {reference}")
    assert reference["num_accepted_tokens"] > 0, "the drafter proposes nothing vLLM accepts"
    assert drafted == reference, "the drafter proposed otherwise after the restore"


def _env(server: VLLMServer) -> dict[str, str]:
    return {k: v for k, v in server.env.items() if k.startswith("KVCLOUD_")}


def drafter_namespace():  # type: ignore[no-untyped-def]
    """SmolLM2's namespace with the drafter: its layer after the target's 30, and the
    drafter's method and checkpoint digest in ``extra``."""
    from kvcloud.integrations.vllm.keys import checkpoint_digest
    from scripts.fleet.vllm_fleet import connector_namespace

    plain = connector_namespace()
    extra = json.loads(plain.extra)
    extra["drafter"] = f"eagle:{checkpoint_digest(str(EAGLE))}"
    return dataclasses.replace(plain, num_layers=31, extra=json.dumps(extra, sort_keys=True))
