"""Multi-turn conversations on two vLLM servers with the connector, no pause between turns
(as an agent sends them): every full chunk a conversation computes reaches the store, once,
and a turn that moves to the other server restores its history up to the previous turn's
last full chunk, answering as a vLLM without the connector.

Turns are built at the token level (turn k's prompt is turn k-1's prompt, its answer's
token ids and the next user message), so "the history" is exact; the chunk the previous
answer completed is only in the store if the decode saved it (``save_decode``).

Issue 40 found most of a conversation's chunks never saved: requests vLLM's own cache
served were scheduled before their index lookup was back and every chunk in vLLM's cache
was taken as stored, so a chunk computed by a turn whose save was lost was never saved
again, and the next server to take the conversation recomputed it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcloud import KVCloud
from scripts.vllm_fleet import (
    VLLMServer,
    cached_tokens,
    completion_ids,
    connector_namespace,
    kvcloud_transfer_config,
    wait_stored,
)
from tests.vllm.conftest import embedded_env, prompt_tokens, serving
from tests.vllm.helpers import assert_same_answer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

CHUNK = 256
ANSWER = 40  # tokens per answer (ignore_eos: always this many)
BLOCK = 128  # vLLM's CPU backend's block size


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return embedded_env(tmp_path_factory.mktemp("conversations"), "conversation-secret")


@pytest.fixture(scope="module")
def servers(store: dict[str, str], vllm_logs: Path) -> Iterator[list[VLLMServer]]:
    a = VLLMServer("convA", vllm_logs / "convA.log", transfer=kvcloud_transfer_config(), env=store)
    # B restores beside the pass (asynchronously), always: the path where a restore failing
    # on its first chunk made vLLM ask again for the same chunks, forever
    b = VLLMServer(
        "convB",
        vllm_logs / "convB.log",
        transfer=kvcloud_transfer_config(load_mode="async"),
        env=store,
    )
    for got in serving(a, b):
        yield [got["convA"], got["convB"]]


@dataclass
class Turn:
    conv: int
    k: int
    server: int
    prompt: list[int]
    resp: dict[str, Any] = field(default_factory=dict)
    prev_server: int = -1
    prev_computed: int = 0  # tokens the previous turn computed (its prompt, answer but last)

    @property
    def moved(self) -> bool:
        return self.prev_server >= 0 and self.prev_server != self.server


def replay(servers: list[VLLMServer], route: str, convs: int, turns: int, seed: int) -> list[Turn]:
    """``convs`` conversations at once, each turn sent as soon as the previous answered;
    ``route``: ``round-robin`` moves every turn, ``least-loaded`` picks the server with
    fewer turns in flight (the previous one on a tie)."""
    lock = threading.Lock()
    in_flight = [0] * len(servers)
    done: list[Turn] = []

    def pick(conv: int, k: int, prev: int) -> int:
        if route == "round-robin":
            return (conv + k) % len(servers)
        best = min(in_flight)
        if prev >= 0 and in_flight[prev] == best:
            return prev
        return in_flight.index(best)

    def conversation(conv: int) -> None:
        history: list[int] = []
        prev, prev_computed = -1, 0
        for k in range(turns):
            user = prompt_tokens(150 + (conv * 97 + k * 61) % 250, seed=seed + 100 * conv + k)
            prompt = history + user
            with lock:
                s = pick(conv, k, prev)
                in_flight[s] += 1
            t = Turn(conv, k, s, prompt, prev_server=prev, prev_computed=prev_computed)
            try:
                t.resp = servers[s].complete(prompt, max_tokens=ANSWER, ignore_eos=True)
            finally:
                with lock:
                    in_flight[s] -= 1
            answer = completion_ids(t.resp)
            with lock:
                done.append(t)
            history = prompt + answer
            prev, prev_computed = s, len(prompt) + len(answer) - 1

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(convs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(done, key=lambda t: (t.conv, t.k))


def totals(servers: list[VLLMServer]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in servers:
        for k, v in s.metrics().items():
            out[k] = out.get(k, 0.0) + v
    return out


@pytest.mark.parametrize(("route", "seed"), [("round-robin", 7000), ("least-loaded", 8000)])
def test_every_chunk_of_a_conversation_is_saved_once_and_restored_when_it_moves(
    servers: list[VLLMServer],
    reference: VLLMServer,
    store: dict[str, str],
    route: str,
    seed: int,
) -> None:
    before = totals(servers)
    turns = replay(servers, route, convs=3, turns=4, seed=seed)
    after = totals(servers)
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
    assert moved, "the routing moved no turn"
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
    servers: list[VLLMServer], reference: VLLMServer, store: dict[str, str]
) -> None:
    """Every object of one stored prompt corrupted, every object of another deleted: B
    (asynchronous restores) answers each right within seconds, each bad object pulled at
    most once (the code before offered the same load again after each failure: a fresh
    server answered neither within 120 s)."""
    a, b = servers
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
        assert_same_answer(got, reference.complete(turn, max_tokens=8), f"B, first chunk {name}")
    delta = {k: v - before.get(k, 0.0) for k, v in b.metrics().items()}
    # one restore each, every object of it pulled once at most (they are pulled in parallel)
    assert delta.get("loads", 0.0) == 2, delta
    assert 1 <= delta.get("verify_failures", 0.0) <= 7, delta
    assert 1 <= delta.get("missing_objects", 0.0) <= 7, delta
    assert delta.get("loads_failed_recomputed", 0.0) == 2, delta
