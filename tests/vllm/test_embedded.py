"""Three vLLM servers sharing KV through kvcloud's embedded default (file:// store +
sqlite:// index), checked against a vLLM without any connector. (A stop right after an
answer, and a fresh server restoring what the stopped one pushed: test_stop.py.) A and B
also replay multi-turn conversations, no pause between turns, moving every other turn.

A writes, and loads with ``load_mode=async``; B loads with ``load_mode=sync`` (the
restore runs inside the step that schedules the request), so every restore into B here is
a synchronous one; C, with other blocks, runs ``load_mode=auto`` with a budget every restore
here meets: its first restore runs beside the forward pass (no rate measured yet), every
later one in the step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcloud import KVCloud
from kvcloud.integrations.vllm.keys import request_tenant
from scripts.fleet.vllm_fleet import (
    VLLMServer,
    cached_tokens,
    completion_ids,
    connector_namespace,
    kvcloud_transfer_config,
    settled,
)
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.conversations import replay
from tests.vllm.helpers import assert_same_answer, wait_stored

# vLLM servers take ~40 s each to start, more when several start together on 2 cores
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHUNK = 256
BLOCK = 128  # vLLM's CPU backend's block size (A's and B's)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("embedded"), "vllm-test-secret")


@pytest.fixture(scope="module")
def servers(
    store: dict[str, str], vllm_logs: Path, checkpoint_copy: Path, reference: VLLMServer
) -> Iterator[dict[str, VLLMServer]]:
    a = VLLMServer(
        "A", vllm_logs / "A.log", transfer=kvcloud_transfer_config(load_mode="async"), env=store
    )
    b = VLLMServer(
        "B", vllm_logs / "B.log", transfer=kvcloud_transfer_config(load_mode="sync"), env=store
    )
    # the same checkpoint copied elsewhere, and vLLM blocks of 64 tokens instead of 128
    c = VLLMServer(
        "C",
        vllm_logs / "C.log",
        model=checkpoint_copy,
        transfer=kvcloud_transfer_config(load_mode="auto", sync_budget_ms=60_000),
        env=store,
        args=["--block-size", "64"],
    )
    yield from serving(a, b, c)


def full_chunks_pushed(prompt_len: int) -> int:
    return prompt_len // CHUNK * CHUNK


def test_second_server_restores_and_answers_like_no_connector(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    a, b = servers["A"], servers["B"]
    prompt = prompt_tokens(2000, seed=1)
    first = a.complete(prompt, max_tokens=16)
    assert cached_tokens(first) == 0
    assert_same_answer(first, reference.complete(prompt, max_tokens=16), "A, cold")
    assert wait_stored(store, prompt) == 7

    turn = prompt + prompt_tokens(120, seed=2)
    got = b.complete(turn, max_tokens=16)
    # every full chunk A pushed (7 × 256 of 2,000 tokens) comes from kvcloud
    assert cached_tokens(got) >= full_chunks_pushed(len(prompt))
    m = b.metrics()
    assert m["loaded_tokens"] >= full_chunks_pushed(len(prompt))
    assert m["load_failed_blocks"] == 0
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "B, restored")


def test_chat_continuation_on_another_server(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    import httpx

    a, b = servers["A"], servers["B"]
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer briefly and cite rule {i}." for i in range(120)
    )
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]

    def chat(server: VLLMServer, msgs: list[dict[str, str]]) -> dict:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "smollm2", "messages": msgs, "max_tokens": 24, "temperature": 0},
            timeout=600,
        )
        r.raise_for_status()
        return r.json()

    first = chat(a, messages)
    rendered = httpx.post(
        a.url + "/tokenize",
        json={"model": "smollm2", "messages": messages, "add_generation_prompt": True},
        timeout=60,
    ).json()["tokens"]
    assert len(rendered) == first["usage"]["prompt_tokens"]
    assert wait_stored(store, rendered) == len(rendered) // CHUNK
    reply = first["choices"][0]["message"]["content"]
    assert reply == chat(reference, messages)["choices"][0]["message"]["content"]
    follow = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And of Italy?"},
    ]
    got = chat(b, follow)
    ref = chat(reference, follow)
    prompt_len = got["usage"]["prompt_tokens"]
    assert prompt_len > 1000
    assert cached_tokens(got) >= full_chunks_pushed(first["usage"]["prompt_tokens"])
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_other_block_size_and_checkpoint_copy_share(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """Segments pushed by a vLLM with 128-token blocks restore into one with 64-token blocks
    started from a copy of the checkpoint in another folder."""
    a, c = servers["A"], servers["C"]
    prompt = prompt_tokens(1500, seed=3)
    a.complete(prompt, max_tokens=4)
    assert wait_stored(store, prompt) == len(prompt) // CHUNK
    turn = prompt + prompt_tokens(40, seed=4)
    got = c.complete(turn, max_tokens=16)
    assert cached_tokens(got) >= full_chunks_pushed(len(prompt))
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "C, block 64, copy")
    # and the other way round: C's pushes (64-token blocks) restore into B (128)
    prompt2 = prompt_tokens(1100, seed=5)
    c.complete(prompt2, max_tokens=4)
    assert wait_stored(store, prompt2) == len(prompt2) // CHUNK
    got2 = servers["B"].complete([*prompt2, 42, 43, 44], max_tokens=16)
    assert cached_tokens(got2) >= full_chunks_pushed(len(prompt2))
    assert_same_answer(
        got2, reference.complete([*prompt2, 42, 43, 44], max_tokens=16), "B from C's pushes"
    )


def test_cache_salt_separates_tenants(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    a, b = servers["A"], servers["B"]
    prompt = prompt_tokens(1300, seed=6)
    a.complete(prompt, max_tokens=2, cache_salt="tenant-one")
    salted = request_tenant("default", "tenant-one")
    assert wait_stored(store, prompt, tenant=salted) == len(prompt) // CHUNK
    other = b.complete([*prompt, 7, 8], max_tokens=8, cache_salt="tenant-two")
    assert cached_tokens(other) == 0
    unsalted = b.complete([*prompt, 7, 8, 9], max_tokens=8)
    assert cached_tokens(unsalted) == 0
    same = b.complete([*prompt, 7, 8, 9, 10], max_tokens=8, cache_salt="tenant-one")
    assert cached_tokens(same) >= full_chunks_pushed(len(prompt))
    assert_same_answer(
        same, reference.complete([*prompt, 7, 8, 9, 10], max_tokens=8), "B, salted hit"
    )


def test_local_prefix_hit_in_the_middle_of_a_chunk(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """C (64-token blocks) already holds the first 640 tokens in its own prefix cache: it
    loads only the rest of chunk 2 (blocks 10 and 11) and chunks 3.., leaving its own blocks
    alone."""
    a, c = servers["A"], servers["C"]
    prompt = prompt_tokens(1900, seed=31)
    c.complete(prompt[:700], max_tokens=1)  # C computes (and caches) 640 tokens' blocks
    a.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt) == len(prompt) // CHUNK
    before = c.metrics()
    turn = [*prompt, *prompt_tokens(20, seed=32)]
    got = c.complete(turn, max_tokens=16)
    assert cached_tokens(got) >= full_chunks_pushed(len(prompt))
    after = c.metrics()
    assert after["loaded_tokens"] - before.get("loaded_tokens", 0) == (
        full_chunks_pushed(len(prompt)) - 640
    )
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "C, mid-chunk local hit")


def test_auto_restores_in_the_step_once_a_restore_was_measured(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """C (``load_mode=auto``): beside the pass while it has measured no restore, in the step
    (vLLM told ``load_async=False``) once it has; the answers as without a connector."""
    a, c = servers["A"], servers["C"]
    for seed in (51, 53):
        prompt = prompt_tokens(1300, seed=seed)
        a.complete(prompt, max_tokens=1)
        assert wait_stored(store, prompt) == len(prompt) // CHUNK
        before = c.metrics()
        turn = [*prompt, *prompt_tokens(30, seed=seed + 1)]
        got = c.complete(turn, max_tokens=16)
        after = c.metrics()
        assert cached_tokens(got) >= full_chunks_pushed(len(prompt))
        measured = before.get("loads", 0) > 0
        in_step = after.get("loads_in_step", 0) - before.get("loads_in_step", 0)
        assert in_step == int(measured), (seed, before, after)
        assert_same_answer(got, reference.complete(turn, max_tokens=16), f"C, auto, {seed}")


def test_exact_multiple_of_the_chunk_recomputes_one_block(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """The same 2,048-token prompt (8 full chunks) again on another server: vLLM must compute
    its last token, so the last chunk is loaded up to the block before it — 1,920 tokens."""
    a, b = servers["A"], servers["B"]
    prompt = prompt_tokens(2048, seed=41)
    a.complete(prompt, max_tokens=1)
    assert wait_stored(store, prompt) == 8
    before = b.metrics()
    got = b.complete(prompt, max_tokens=12)
    assert cached_tokens(got) == 2048 - 128
    assert b.metrics()["loaded_tokens"] - before.get("loaded_tokens", 0) == 2048 - 128
    assert_same_answer(got, reference.complete(prompt, max_tokens=12), "B, exact multiple")


def test_an_answer_is_restored_on_another_server(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """Turn n's answer is part of turn n+1's prompt: the chunk A's decode filled is pushed,
    so B restores the answer too instead of recomputing it."""
    a, b = servers["A"], servers["B"]
    prompt = prompt_tokens(250, seed=31)
    first = a.complete(prompt, max_tokens=270, ignore_eos=True)
    history = [*prompt, *completion_ids(first)]
    assert len(history) == 520
    # chunk 0 ends inside the prompt; chunk 1 (tokens 256..511) holds answer tokens only
    assert wait_stored(store, history) == 2
    turn = [*history, *prompt_tokens(60, seed=32)]
    got = b.complete(turn, max_tokens=16)
    assert cached_tokens(got) >= 2 * CHUNK
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "B, answer restored")


def test_a_corrupt_object_under_sync_loads_is_recomputed(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """B loads synchronously: a chunk failing verification is reported after the step
    that loaded it; vLLM drops that step's output and recomputes from the bad chunk."""
    a, b = servers["A"], servers["B"]
    prompt = prompt_tokens(1100, seed=33)  # 4 full chunks
    a.complete(prompt, max_tokens=2)
    assert wait_stored(store, prompt) == 4
    ns = connector_namespace()
    with KVCloud.open(
        store=store["KVCLOUD_STORE"], index=store["KVCLOUD_INDEX"], secret=store["KVCLOUD_SECRET"]
    ) as k:
        fps = k.fingerprints(ns, prompt, "default")
        entries = k.index.lookup(ns.id, [fp.hex() for fp in fps])
        key = entries[1].object_key
        body = bytearray(k.store.get(key))
        body[len(body) // 2] ^= 0xFF
        k.store.delete(key)
        k.store.put(key, bytes(body))
    before = b.metrics()
    turn = [*prompt, *prompt_tokens(40, seed=34)]
    got = b.complete(turn, max_tokens=16)
    assert_same_answer(got, reference.complete(turn, max_tokens=16), "B, sync, corrupt chunk")
    after = b.metrics()
    delta = {name: after[name] - before.get(name, 0) for name in after}
    assert delta["verify_failures"] == 1
    assert delta["loaded_tokens"] == CHUNK
    assert delta["load_failed_blocks"] == 3 * CHUNK // 128
    # the damaged object is deleted after its entry, and vLLM took B back to chunk 1 and
    # recomputed from there: those chunks are saved again (before, nobody saved chunk 1 and
    # a re-push of the same bytes named the damaged object again)
    assert delta.get("damaged_deleted", 0) == 1
    assert delta.get("saves_rewound", 0) == 1
    assert wait_stored(store, prompt) == 4
    c = servers["C"]
    before_c = c.metrics()
    again = [*prompt, *prompt_tokens(40, seed=35)]
    got2 = c.complete(again, max_tokens=8)
    assert cached_tokens(got2) >= 4 * CHUNK
    assert c.metrics().get("verify_failures", 0) == before_c.get("verify_failures", 0)
    assert_same_answer(got2, reference.complete(again, max_tokens=8), "C, after B re-saved")


def test_every_chunk_of_a_conversation_is_saved_once_and_restored_when_it_moves(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """Three conversations of four turns at once on A and B, no pause between turns (as an
    agent sends them), moving at turns 1 and 3: every full chunk a conversation computes
    reaches the store, once, and a turn that moved restores its history up to the previous
    turn's last full chunk, answering as a vLLM without the connector. (Issue 40 found most
    of a conversation's chunks never saved: a request vLLM's own cache served was scheduled
    before its index lookup was back and every chunk in that cache was taken as stored.)"""
    pair = [servers["A"], servers["B"]]
    route = "A/B, moving every other turn"
    before = settled(pair)
    turns = replay(pair, convs=3, turns=4, seed=7000)
    after = settled(pair)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # every conversation's full chunks, from its last turn: prompt and answer but the last
    # token (sampled, its KV never computed)
    last = {t.conv: t for t in turns}
    unique = 0
    for t in last.values():
        computed = t.prompt + completion_ids(t.resp)[:-1]
        n = len(computed) // CHUNK
        unique += n
        # every one reaches the store (pushes are asynchronous: a few seconds at most)
        assert wait_stored(store, computed, want=n, timeout=30) == n, f"conversation {t.conv}"
    queued = delta.get("chunks_queued", 0.0)
    print(
        f"{route}: {len(turns)} turns, {unique} full chunks, {queued:.0f} queued, "
        f"{delta.get('chunks_pushed', 0.0):.0f} pushed, "
        f"{delta.get('chunks_already_stored', 0.0):.0f} already stored, "
        f"{delta.get('chunks_backfilled', 0.0):.0f} backfilled, "
        f"{delta.get('lookups_not_waited', 0.0):.0f} lookups not waited, "
        f"{delta.get('loaded_tokens', 0.0):.0f} tokens restored"
    )
    # stored once: nothing dropped, each chunk pushed once. A chunk the previous turn's
    # last decode steps completed may still be in the other server's upload queue when a
    # moved turn looks it up (the save lag): that turn recomputes it and queues it again,
    # found already stored; at most one such chunk per moved turn
    moved = [t for t in turns if t.moved]
    assert len(moved) == 6 and sum(t.k > 0 and not t.moved for t in turns) == 3
    assert delta.get("upload_dropped", 0.0) == 0
    assert delta.get("chunks_pushed", 0.0) == unique
    assert unique <= queued <= unique + len(moved), f"{queued:.0f} queued for {unique} chunks"
    for t in moved:
        # the history up to the previous turn's last full chunk, from kvcloud, but never
        # the block holding the prompt's last token (vLLM computes it to sample)
        # (less the chunk the previous turn's last decode steps completed, which may still
        # be in the upload queue when this turn is looked up: the save lag)
        want = min(t.prev_computed // CHUNK * CHUNK, (len(t.prompt) - 1) // BLOCK * BLOCK)
        got = cached_tokens(t.resp)
        assert got >= want - CHUNK, f"conversation {t.conv} turn {t.k}: {got} of {want} restored"
        label = f"{route}: conversation {t.conv} turn {t.k} (moved)"
        ref = reference.complete(t.prompt, max_tokens=16)
        first16 = dict(t.resp)
        # the turn's answer was 40 tokens; compare its first 16 with the reference's
        first16["choices"] = [
            {
                **t.resp["choices"][0],
                "token_ids": completion_ids(t.resp)[:16],
                "logprobs": {
                    "token_logprobs": (t.resp["choices"][0].get("logprobs") or {}).get(
                        "token_logprobs", []
                    )[:16]
                },
            }
        ]
        assert_same_answer(first16, ref, label)


def test_a_restore_failing_on_its_first_chunk_is_recomputed_at_once(
    servers: dict[str, VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """Every object of one stored prompt corrupted, every object of another deleted: A
    (asynchronous restores) answers each right within seconds, each bad object pulled at
    most once (the code before offered the same load again after each failure: a fresh
    server answered neither within 120 s)."""
    b, a = servers["A"], servers["B"]  # B stores, A restores
    corrupt, deleted = prompt_tokens(1800, seed=9100), prompt_tokens(1800, seed=9200)
    ns = connector_namespace()
    keys: dict[str, list[str]] = {}
    for name, prompt in (("corrupt", corrupt), ("deleted", deleted)):
        a.complete(prompt, max_tokens=2)
        assert wait_stored(store, prompt) == 7
        with KVCloud.open(
            store=store["KVCLOUD_STORE"],
            index=store["KVCLOUD_INDEX"],
            secret=store["KVCLOUD_SECRET"],
        ) as k:
            keys[name] = [ref.entry.object_key for ref in k.lookup(ns, prompt).chunks]
    root = Path(store["KVCLOUD_STORE"].removeprefix("file://"))
    for key in keys["corrupt"]:
        path = root / key
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: the digest check
        path.write_bytes(bytes(data))
    for key in keys["deleted"]:
        (root / key).unlink()
    before = b.metrics()
    for name, prompt in (("corrupt", corrupt), ("deleted", deleted)):
        turn = [*prompt, *prompt_tokens(40, seed=9300)]
        t0 = time.monotonic()
        got = b.complete(turn, max_tokens=8)
        took = time.monotonic() - t0
        assert took < 60, f"{name}: answered in {took:.0f} s"
        assert_same_answer(got, reference.complete(turn, max_tokens=8), f"A, first chunk {name}")
    delta = {k: v - before.get(k, 0.0) for k, v in b.metrics().items()}
    # one restore each, every object of it pulled once at most (they are pulled in parallel)
    assert delta.get("loads", 0.0) == 2, delta
    assert 1 <= delta.get("verify_failures", 0.0) <= 7, delta
    assert 1 <= delta.get("missing_objects", 0.0) <= 7, delta
    assert delta.get("loads_failed_recomputed", 0.0) == 2, delta
