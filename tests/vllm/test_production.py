"""The connector under the conditions real servers live in, on real vLLM servers, each answer
checked against a vLLM without the connector (same flags otherwise):

- a starved KV cache that preempts several concurrent requests, whose resumed prompts must be
  loaded again, with chunked prefill on;
- LoRA: base and adapter requests on the same prompt never share KV;
- ngram speculative decoding with a corrupt object in the store;
- the negative control of the answer check (``assert_same_answer``): a wrong restore fails it.

Servers (kvcloud's embedded default, shared by the module): W writes (LoRA and ngram
speculative decoding on), P is starved (few KV blocks, small prefill chunks, LoRA on), RL is
the reference (LoRA on, no connector).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvcloud import KVCloud
from kvcloud.integrations.vllm.keys import request_scope
from scripts.fleet.vllm_fleet import (
    LORA,
    VLLMServer,
    cached_tokens,
    completion_ids,
    kvcloud_transfer_config,
)
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import (
    assert_same_answer,
    connector_namespace,
    plant_kv,
    wait_stored,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

CHUNK = 256
LORA_ARGS = ["--enable-lora", "--lora-modules", f"ad={LORA}", "--max-lora-rank", "8"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


if not (LORA / "adapter_config.json").exists():
    raise RuntimeError(f"{LORA} is missing: run `make install-vllm` (make test does)")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("production"), "vllm-production-secret")


@pytest.fixture(scope="module")
def servers(store: dict[str, str], vllm_logs: Path) -> Iterator[dict[str, VLLMServer]]:
    cfg = kvcloud_transfer_config()
    w = VLLMServer(
        "W",
        vllm_logs / "W.log",
        transfer=cfg,
        env=store,
        args=[*LORA_ARGS, "--speculative-config", json.dumps(NGRAM)],
    )
    # 80 blocks of 32 tokens (2,560 tokens; the CPU backend's smallest block) for 8 requests
    # of ~30 blocks each: vLLM must preempt. vLLM's own prefix cache is off, so a resumed
    # request has nothing of its prompt left locally and kvcloud must load it again (with
    # the cache on, the freed prompt blocks usually survive the preemption and the resumed
    # request never asks kvcloud for more than it did the first time)
    p = VLLMServer(
        "P",
        vllm_logs / "P.log",
        transfer=cfg,
        env=store,
        args=[
            *LORA_ARGS,
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "80",
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "256",
            "--max-num-seqs",
            "8",
            "--no-enable-prefix-caching",
        ],
    )
    rl = VLLMServer("RL", vllm_logs / "RL.log", args=LORA_ARGS, in_process=True)
    yield from serving(w, p, rl)


def metric_total(server: VLLMServer, name: str) -> float:
    """One of vLLM's own counters, summed over its labels."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def preemptions(server: VLLMServer) -> float:
    return metric_total(server, "vllm:num_preemptions_total")


def test_preempted_requests_answer_like_no_connector(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    w, p, rl = servers["W"], servers["P"], servers["RL"]
    prompts = [prompt_tokens(530 + 37 * i, seed=100 + i) for i in range(8)]
    for prompt in prompts:  # kvcloud holds every full chunk of every prompt
        w.complete(prompt, max_tokens=1)
    for prompt in prompts:
        assert wait_stored(store, prompt) == len(prompt) // CHUNK
    turns = [[*prompt, *prompt_tokens(40, seed=200 + i)] for i, prompt in enumerate(prompts)]
    gen = {"max_tokens": 180, "ignore_eos": True}
    before_pre, before = preemptions(p), p.metrics()
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: p.complete(t, **gen), turns))
    preempted = preemptions(p) - before_pre
    assert preempted >= 1, "the starved server never preempted"
    after = p.metrics()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    # the first admissions can be offered each prompt's stored chunks once (17 chunks, 4,352
    # tokens), no more: P's own saves of a turn come after its lookup, and the prompts share
    # nothing. Each preemption freed a running request's blocks (prefix cache off: nothing
    # left locally), so its resumption is offered its prompt's stored chunks again (at least
    # 2); and the restores loaded beyond the first admissions.
    first = sum(len(prompt) // CHUNK for prompt in prompts) * CHUNK
    assert delta["hit_tokens"] >= first + preempted * 2 * CHUNK, (preempted, delta)
    assert delta["loaded_tokens"] > first, (preempted, delta)
    print(
        f"P: {preempted:.0f} preemptions; offered {delta['hit_tokens']:.0f} tokens, loaded "
        f"{delta['loaded_tokens']:.0f} (first admissions at most {first})"
    )
    # the reference answers the same batch at once (P's batched, preempted answers equal
    # each one answered alone too; batched costs one decode step for all eight)
    with cf.ThreadPoolExecutor(8) as pool:
        refs = list(pool.map(lambda t: rl.complete(t, **gen), turns))
    for i, (resp, ref) in enumerate(zip(got, refs, strict=True)):
        assert_same_answer(resp, ref, f"P, preempted request {i}")
    # what P saved across its preemptions is checked by another server: every full chunk P
    # computed (prompt and answer) is stored, and W, which never saw the answers, continues
    # each conversation from exactly P's tokens, restoring P's chunks, and answers as the
    # reference does (a save that read another request's blocks would change this answer)
    conts, stored = [], []
    for i, (turn, resp) in enumerate(zip(turns, got, strict=True)):
        history = [*turn, *completion_ids(resp)]
        n = (len(history) - 1) // CHUNK  # the answer's last token's KV is never computed
        assert wait_stored(store, history[: n * CHUNK], want=n) == n, f"P's turn {i}"
        conts.append([*history, *prompt_tokens(8, seed=400 + i)])
        stored.append(n)
    # (batched: W's and the reference's eight continuations each run at once)
    with cf.ThreadPoolExecutor(8) as pool:
        mores = list(pool.map(lambda c: w.complete(c, max_tokens=8), conts))
        refs = list(pool.map(lambda c: rl.complete(c, max_tokens=8), conts))
    for i, (cont, n, more, ref) in enumerate(zip(conts, stored, mores, refs, strict=True)):
        assert cached_tokens(more) >= min(n * CHUNK, (len(cont) - 1) // 128 * 128), i
        assert_same_answer(more, ref, f"W continues P's turn {i}")


def adapter_tenant() -> str:
    lora = SimpleNamespace(lora_name="ad", lora_path=str(LORA))
    return request_scope("default", SimpleNamespace(lora_request=lora))


def test_base_and_adapter_never_share_kv(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    w, p, rl = servers["W"], servers["P"], servers["RL"]
    gen = {"max_tokens": 16}
    # base first, adapter second (and the reverse), each on a server that has not seen the
    # prompt: P's own prefix cache is empty for it, so a hit could only come from kvcloud
    for first, second, seed in (("smollm2", "ad", 300), ("ad", "smollm2", 301)):
        prompt = prompt_tokens(800, seed=seed)
        w.complete(prompt, model=first, max_tokens=1)
        tenant = adapter_tenant() if first == "ad" else "default"
        assert wait_stored(store, prompt, tenant=tenant) == 3
        turn = [*prompt, 11, 12, 13]
        got = p.complete(turn, model=second, **gen)
        assert cached_tokens(got) == 0, f"{second} after {first} found {first}'s KV"
        assert_same_answer(got, rl.complete(turn, model=second, **gen), f"{second} after {first}")
    # the adapter's own KV is shared, and restores exactly
    prompt = prompt_tokens(800, seed=302)
    w.complete(prompt, model="ad", max_tokens=1)
    assert wait_stored(store, prompt, tenant=adapter_tenant()) == 3
    turn = [*prompt, 21, 22]
    got = p.complete(turn, model="ad", **gen)
    assert cached_tokens(got) >= 3 * CHUNK
    assert_same_answer(got, rl.complete(turn, model="ad", **gen), "adapter after adapter")


def spec_drafts(server: VLLMServer) -> float:
    return metric_total(server, "vllm:spec_decode_num_draft_tokens_total")


def test_speculative_decoding_with_a_corrupt_object(
    servers: dict[str, VLLMServer], store: dict[str, str]
) -> None:
    w, p, rl = servers["W"], servers["P"], servers["RL"]
    # a prompt that repeats itself, so ngram proposes drafts from it
    phrase = prompt_tokens(40, seed=400)
    prompt = (phrase * 30)[:1100]
    p.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt) == 4
    ns = connector_namespace()
    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as kvc:
        fps = kvc.fingerprints(ns, prompt, "default")
        key = kvc.index.lookup(ns.id, [fp.hex() for fp in fps])[1].object_key
        data = bytearray(kvc.store.get(key))
        data[len(data) // 2] ^= 0x40  # chunk 1, same size: only the digest can tell
        kvc.store.delete(key)
        kvc.store.put(key, bytes(data))
    before, drafts = w.metrics(), spec_drafts(w)
    turn = [*prompt, *phrase[:7]]
    got = w.complete(turn, max_tokens=48, ignore_eos=True)
    after = w.metrics()
    assert after["verify_failures"] - before.get("verify_failures", 0) == 1
    assert after["loaded_tokens"] - before.get("loaded_tokens", 0) == CHUNK  # chunk 0 only
    assert spec_drafts(w) > drafts, "ngram proposed no draft tokens"
    assert_same_answer(
        got, rl.complete(turn, max_tokens=48, ignore_eos=True), "W, ngram + corrupt object"
    )


@pytest.mark.parametrize(
    ("label", "changed"),
    [
        # the same prompt but for one token at 700, in its third and last stored chunk: the
        # first 188 tokens of the chunk and the two chunks before it are exactly right
        ("one token changed", [700]),
        ("another prompt", range(800)),
    ],
)
def test_a_wrong_restore_fails_the_answer_check(
    servers: dict[str, VLLMServer], store: dict[str, str], label: str, changed: Sequence[int]
) -> None:
    """The negative control of assert_same_answer, which every vLLM module's answers go
    through: another prompt's KV, stored under this prompt's key (each object well formed
    and verifying), is restored, and the check must fail."""
    w, p, rl = servers["W"], servers["P"], servers["RL"]
    seed = 500 + len(changed)
    victim = prompt_tokens(800, seed=seed)
    other = prompt_tokens(800, seed=seed + 1)
    donor = [other[i] if i in changed else t for i, t in enumerate(victim)]
    assert donor != victim
    w.complete(donor, max_tokens=1)
    assert wait_stored(store, donor) == 3
    # chunks whose prefix differs get the donor's KV (1 or 3); those before are the same
    wrong = sum(donor[: (i + 1) * CHUNK] != victim[: (i + 1) * CHUNK] for i in range(3))
    assert plant_kv(store, victim, donor) == wrong
    turn = [*victim, 31, 32]
    before = p.metrics()
    got = p.complete(turn, max_tokens=16)
    after = p.metrics()
    # P restored the planted KV (its prefix cache is off: nothing of it came from elsewhere)
    assert after["loaded_tokens"] - before.get("loaded_tokens", 0) == 3 * CHUNK
    assert after.get("verify_failures", 0) == before.get("verify_failures", 0)
    ref = rl.complete(turn, max_tokens=16)
    with pytest.raises(AssertionError) as caught:
        assert_same_answer(got, ref, f"P, wrong restore: {label}")
    print(f"{label}: the check failed as it must: {str(caught.value).splitlines()[0][:300]}")
