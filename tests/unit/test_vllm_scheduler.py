"""The vLLM connector's scheduler side without vLLM: requests shaped like vLLM's, a real
file store and SQLite index, and a real socket that never answers for the hung index.

Checked against what vLLM 0.32's scheduler does (``v1/core/sched/scheduler.py``):
- a request resumed after a preemption asks again, gets its blocks again, and its load is
  sent (it arrives in ``scheduled_cached_reqs.resumed_req_ids``, not as a new request);
- keys cover what vLLM's block hash covers: a LoRA adapter (name and weights), multimodal
  inputs, ``cache_salt``; prompt embeddings skip kvcloud, counted;
- the scheduler thread never waits on the index for more than a few milliseconds: a hung
  index defers the request (``None``) while others are scheduled, gives up at
  ``lookup_timeout``, and opens the breaker so later requests miss at once;
- what the workers report (a remembered-bad object, an open store breaker) stops offers.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcloud import KVCloud
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.scheduler import SchedulerSide
from kvcloud.integrations.vllm.specs import KVCloudWorkerMeta
from tests.helpers import make_kv, make_ns, make_tokens

BS = 8  # vLLM block size: two blocks per 16-token chunk
C = 16


def request(rid: str, tokens: list[int], **extra: object) -> SimpleNamespace:
    fields: dict[str, object] = dict(
        request_id=rid,
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),  # vLLM's Request: the prompt, then each accepted token
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def output(new: list = (), cached: tuple = (), resumed: set[str] = frozenset()) -> SimpleNamespace:  # type: ignore[assignment]
    """A SchedulerOutput with what the scheduler side reads."""
    req_ids = [c[0] for c in cached]
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=req_ids,
            resumed_req_ids=set(resumed),
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens={c[0]: c[3] for c in cached},
    )


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[KVCloud, list[int]]]:
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    tokens = [int(t) for t in make_tokens(4 * C + 5)]
    ns = make_ns("float32")
    kvc.push(ns, tokens[: 4 * C], make_kv(ns, 4 * C))
    yield kvc, tokens
    kvc.close()


def side(kvc: KVCloud, **cfg: object) -> SchedulerSide:
    config = VLLMConnectorConfig(chunk_tokens=C, **cfg)  # type: ignore[arg-type]
    return SchedulerSide(config, make_ns("float32"), kvc, BS)


def ask(
    s: SchedulerSide, req: SimpleNamespace, local: int = 0, wait: float = 5.0, sync: bool = False
) -> int:
    """Ask as vLLM does, step after step, until the connector answers."""
    deadline = time.monotonic() + wait
    while True:
        n, is_async = s.get_num_new_matched_tokens(req, local)
        if n is not None:
            assert is_async == (n > 0 and not sync)
            return n
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_a_preempted_request_gets_its_load_again(stored: tuple[KVCloud, list[int]]) -> None:
    kvc, tokens = stored
    s = side(kvc)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C  # every stored chunk: the tail is computed
    first = list(range(20, 29))
    s.update_state_after_alloc(req, Blocks(first), 4 * C)
    meta = s.build_connector_meta(output())
    assert [ld.req_id for ld in meta.loads] == ["r1"]
    assert [ch.block_ids for ch in meta.loads[0].chunks] == [first[i : i + 2] for i in (0, 2, 4, 6)]
    # the load done, vLLM schedules the request (without asking again: it has computed
    # tokens), then preempts it: it resets num_computed_tokens, asks again, allocates other
    # blocks; the request comes back among the cached requests, flagged resumed
    new = SimpleNamespace(req_id="r1", block_ids=(first,), num_computed_tokens=4 * C)
    s.build_connector_meta(SimpleNamespace(**{**vars(output()), "scheduled_new_reqs": [new]}))
    assert ask(s, req) == 4 * C
    again = list(range(40, 49))
    s.update_state_after_alloc(req, Blocks(again), 4 * C)
    meta = s.build_connector_meta(output(cached=[("r1", again, 4 * C, 5)], resumed={"r1"}))
    assert [ld.req_id for ld in meta.loads] == ["r1"]
    assert [ch.block_ids for ch in meta.loads[0].chunks] == [again[i : i + 2] for i in (0, 2, 4, 6)]


def test_an_adapter_never_shares_the_base_models_kv(
    stored: tuple[KVCloud, list[int]], tmp_path: Path
) -> None:
    kvc, tokens = stored
    s = side(kvc)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    lora = SimpleNamespace(lora_name="ad", lora_path=str(adapter), lora_int_id=1)
    assert ask(s, request("base", tokens)) == 4 * C
    assert ask(s, request("lora", tokens, lora_request=lora)) == 0
    salted = request("salt", tokens, cache_salt="tenant-b")
    assert ask(s, salted) == 0
    # the adapter's chunks are keyed by its weights: other weights under the same name, or
    # the same weights under another name, are other keys
    s1 = s.request_scope_of(request("x", tokens, lora_request=lora))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-2")
    s2 = s.request_scope_of(request("x", tokens, lora_request=lora))
    renamed = SimpleNamespace(lora_name="other", lora_path=str(adapter), lora_int_id=2)
    s3 = s.request_scope_of(request("x", tokens, lora_request=renamed))
    assert len({s1, s2, s3, s.request_scope_of(request("x", tokens))}) == 4


def test_multimodal_inputs_and_prompt_embeddings(stored: tuple[KVCloud, list[int]]) -> None:
    kvc, tokens = stored
    s = side(kvc)

    def image(ident: str, offset: int) -> SimpleNamespace:
        return SimpleNamespace(
            identifier=ident, mm_position=SimpleNamespace(offset=offset, length=10)
        )

    scopes = {
        s.request_scope_of(request("x", tokens, mm_features=feats))
        for feats in ([image("cat", 3)], [image("dog", 3)], [image("cat", 20)], None)
    }
    assert len(scopes) == 4  # same placeholder tokens, other image or place: other keys
    assert ask(s, request("mm", tokens, mm_features=[image("cat", 3)])) == 0
    embeds = request("emb", tokens, prompt_embeds=object())
    assert ask(s, embeds) == 0
    assert s.take_stats()["requests_skipped"] == 1


class Blackhole:
    """A TCP port that accepts connections and never answers (a hung Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class WaitsSeen:
    """A lookup's future that records the timeout of every wait on it."""

    def __init__(self, future: Any) -> None:
        self.future = future
        self.waits: list[float | None] = []

    def result(self, timeout: float | None = None) -> Any:
        self.waits.append(timeout)
        return self.future.result(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.future, name)


def hung_index_client(tmp_path: Path, hole: Blackhole) -> KVCloud:
    """A client whose index is the black hole (its store a local folder)."""
    return KVCloud.open(
        store=f"file://{tmp_path}/o",
        index=f"redis://127.0.0.1:{hole.port}/0",
        read_timeout=5.0,
        secret="s",
    )


def test_a_hung_index_never_holds_the_scheduler(tmp_path: Path) -> None:
    hole = Blackhole()
    try:
        kvc = hung_index_client(tmp_path, hole)
        s = side(kvc, lookup_timeout=0.5, breaker_failures=2, breaker_backoff=30.0)
        tokens = [int(t) for t in make_tokens(4 * C + 5)]
        req = request("r0", tokens)
        s.on_new_request(req)
        lookup = s._pending["r0"].future = WaitsSeen(s._pending["r0"].future)
        t_start = time.monotonic()
        asks = 0
        while True:
            n, _ = s.get_num_new_matched_tokens(req, 0)
            asks += 1
            if n is not None:
                break
            time.sleep(0.001)  # vLLM's idle step
        assert n == 0
        assert time.monotonic() - t_start >= 0.5  # the request waited, alone, its timeout
        # only the first ask waits, its lookup_wait_ms (20 ms); every later one just looks
        # (the behaviour, not its timing: a busy 2-core machine stretches any time)
        assert lookup.waits[0] == 0.02 and asks > 1
        assert lookup.waits[1:] == [0.0] * (len(lookup.waits) - 1)
        # one timeout opens the breaker: it already cost that request the whole wait
        assert s.index_breaker.is_open
        stats = s.take_stats()
        assert stats["lookup_timeouts"] == 1 and stats["index_breaker_opened"] == 1
        assert stats["index_breaker_open"] == 1
        # breaker open: no connection, an answer at once
        before = hole.accepted
        assert s.get_num_new_matched_tokens(request("r9", tokens), 0) == (0, False)
        assert "r9" not in s._pending  # answered without a lookup
        assert s.take_stats()["lookups_skipped"] == 1
        time.sleep(0.05)
        assert hole.accepted == before
        s.shutdown()
    finally:
        hole.close()


def test_worker_reports_stop_offers(stored: tuple[KVCloud, list[int]]) -> None:
    kvc, tokens = stored
    s = side(kvc)
    plan_req = request("r1", tokens)
    assert ask(s, plan_req) == 4 * C
    bad = s._plans["r1"].match.chunks[2].entry.object_key  # type: ignore[union-attr]
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KVCloudWorkerMeta({bad: 60.0}))
    )
    assert ask(s, request("r2", tokens)) == 2 * C  # cut before the bad object
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KVCloudWorkerMeta(store_retry_in=30.0))
    )
    assert ask(s, request("r3", tokens)) == 0
    assert s.take_stats()["loads_skipped"] >= 1
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KVCloudWorkerMeta(store_ok=True))
    )
    assert ask(s, request("r4", tokens)) == 2 * C


def test_chunks_out_of_a_sliding_window_are_never_saved(tmp_path: Path) -> None:
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    s = side(kvc)
    tokens = [int(t) for t in make_tokens(3 * C + 5)]  # nothing stored: all three are saved
    req = request("r1", tokens)
    assert ask(s, req) == 0
    # chunk 0 already fell out of the window: vLLM holds its null block (0) there
    new = SimpleNamespace(req_id="r1", block_ids=([0, 0, 5, 6, 7, 8, 9],), num_computed_tokens=0)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": len(tokens)}
    meta = s.build_connector_meta(out)
    assert [ch.position for spec in meta.saves for ch in spec.chunks] == [1, 2]
    assert [ch.block_ids for spec in meta.saves for ch in spec.chunks] == [[5, 6], [7, 8]]
    kvc.close()


def saved(meta: object) -> list[tuple[int, bytes, list[int]]]:
    return [(ch.position, ch.fp, ch.block_ids) for spec in meta.saves for ch in spec.chunks]  # type: ignore[attr-defined]


@pytest.mark.parametrize("save_decode", [True, False])
def test_chunks_an_answer_fills_are_saved_as_they_fill(tmp_path: Path, save_decode: bool) -> None:
    """Turn n's answer is turn n+1's prompt: the chunk the decode completes is pushed in
    the step that computes its last token, keyed like a prompt holding those tokens."""
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    s = side(kvc, save_decode=save_decode)
    tokens = [int(t) for t in make_tokens(2 * C + 5)]
    req = request("r1", tokens)
    assert ask(s, req) == 0
    blocks = [10, 11, 12, 13, 14]
    new = SimpleNamespace(req_id="r1", block_ids=(blocks,), num_computed_tokens=0)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": len(tokens)}
    assert [pos for pos, _, _ in saved(s.build_connector_meta(out))] == [0, 1]
    answer = [int(t) for t in make_tokens(C, seed=7)]
    for i in range(C - 5):  # decode steps that do not finish chunk 2 save nothing
        req.all_token_ids.append(answer[i])
        step = output(cached=[("r1", None, len(req.all_token_ids) - 1, 1)])
        assert saved(s.build_connector_meta(step)) == []
    # the step computing the chunk's last token (position 3C-1) saves it; vLLM gave the
    # request block 15 for the answer on the way
    req.all_token_ids.append(answer[C - 5])
    step = output(cached=[("r1", [15], len(req.all_token_ids) - 1, 1)])
    got = saved(s.build_connector_meta(step))
    if not save_decode:
        assert got == []
        kvc.close()
        return
    all_tokens = tokens + answer[: C - 4]
    want_fp = kvc.fingerprints(make_ns("float32"), all_tokens[: 3 * C])[2]
    assert got == [(2, want_fp, [14, 15])]
    kvc.close()


def test_draft_tokens_never_end_a_saved_chunk(tmp_path: Path) -> None:
    """Speculative decoding computes KV for draft tokens vLLM may reject: a chunk is saved
    only once vLLM has accepted every token in it."""
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    s = side(kvc)
    tokens = [int(t) for t in make_tokens(C - 2)]
    req = request("r1", tokens)
    assert ask(s, req) == 0
    new = SimpleNamespace(req_id="r1", block_ids=([3, 4],), num_computed_tokens=0)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": len(tokens)}
    assert saved(s.build_connector_meta(out)) == []
    req.all_token_ids.append(99)  # one accepted token, then a step with 3 drafts
    step = output(cached=[("r1", None, C - 2, 4)])  # KV for positions C-2 .. C+1
    assert saved(s.build_connector_meta(step)) == []
    req.all_token_ids.extend([98, 97])  # two drafts accepted: now chunk 0 is known
    step = output(cached=[("r1", [5], C + 1, 1)])
    assert [pos for pos, _, _ in saved(s.build_connector_meta(step))] == [0]
    kvc.close()


def test_sync_load_mode_offers_loads_as_synchronous(stored: tuple[KVCloud, list[int]]) -> None:
    kvc, tokens = stored
    s = side(kvc, load_mode="sync")
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req, sync=True) == 4 * C


def test_auto_load_mode_puts_a_restore_in_the_step_only_when_measured_short(
    stored: tuple[KVCloud, list[int]],
) -> None:
    """``load_mode=auto``: beside the pass until a rate is known; then in the step when the
    objects to pull take at most ``sync_budget_ms`` at the measured rate (in-step restores'
    rate first, else twice the rate of those beside the pass), and the spec says so."""
    kvc, tokens = stored
    s = side(kvc, load_mode="auto", sync_budget_ms=50)

    def offer(rid: str, local: int = 0) -> tuple[int, bool]:
        req = request(rid, tokens)
        s.on_new_request(req)
        n, is_async = None, True
        while n is None:  # as vLLM asks, step after step
            n, is_async = s.get_num_new_matched_tokens(req, local)
            time.sleep(0.001)
        s.update_state_after_alloc(req, Blocks(list(range(100, 109))), n)
        (spec,) = s.build_connector_meta(output()).loads
        assert spec.sync == (not is_async)  # the worker settles what vLLM was told
        return n, spec.sync

    assert offer("r1") == (4 * C, False)  # no rate known: beside the pass
    all4 = sum(ref.entry.size for ref in s._plans["r1"].match.chunks)  # type: ignore[union-attr]

    def report(**rates: float) -> None:
        meta = KVCloudWorkerMeta(**rates)  # type: ignore[arg-type]
        s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))

    report(beside_bytes=all4, beside_s=0.12)  # beside: 120 ms, so 60 ms in the step: too long
    assert offer("r2") == (4 * C, False)
    report(beside_bytes=all4, beside_s=0.03)  # average now 90 ms beside, 45 ms in the step
    assert offer("r3") == (4 * C, True)
    # in-step restores measured slow (160 ms for all four): that rate rules, not beside's
    report(in_step_bytes=all4, in_step_s=0.16)
    assert offer("r4") == (4 * C, False)
    # vLLM holds three chunks itself: one object to pull, 40 ms at that rate
    assert offer("r5", local=3 * C) == (C, True)
    assert s.take_stats()["loads_in_step"] == 2
    # sync and async ignore the rates
    for mode, in_step in (("sync", True), ("async", False)):
        other = side(kvc, load_mode=mode)
        fast = KVCloudWorkerMeta(in_step_bytes=1 << 40, in_step_s=1.0)
        other.update_connector_output(SimpleNamespace(kv_connector_worker_meta=fast))
        req = request("x", tokens)
        other.on_new_request(req)
        assert ask(other, req, sync=in_step) == 4 * C


def test_a_prefix_vllm_holds_itself_never_waits_for_the_index(tmp_path: Path) -> None:
    """vLLM's own cache already holds every block before the prompt's last token: nothing
    kvcloud holds could be offered, so vLLM gets its answer at once even from a hung index,
    and the chunks beyond its cache are still saved (those in it are taken as stored)."""
    hole = Blackhole()
    try:
        kvc = hung_index_client(tmp_path, hole)
        tokens = [int(t) for t in make_tokens(3 * C + 1)]  # last token alone in chunk 3
        # vLLM's hit stops a block short of the last one: the lookup could add a block, so
        # the first ask waits its lookup_wait_ms for the (hung) index
        s = side(kvc, lookup_wait_ms=300, lookup_timeout=5.0)
        req = request("r1", tokens)
        s.on_new_request(req)
        t0 = time.perf_counter()
        assert s.get_num_new_matched_tokens(req, 3 * C - BS) == (None, False)
        assert time.perf_counter() - t0 >= 0.25
        # vLLM's hit reaches the last block: an answer at once
        s2 = side(kvc, lookup_wait_ms=300, lookup_timeout=5.0)
        req2 = request("r2", tokens)
        s2.on_new_request(req2)
        lookup = s2._pending["r2"].future = WaitsSeen(s2._pending["r2"].future)
        assert s2.get_num_new_matched_tokens(req2, 3 * C) == (0, False)
        assert lookup.waits == []  # never waited on
        assert s2.take_stats()["lookups_not_waited"] == 1
        # scheduled with the lookup still out: the chunk beyond vLLM's hit of 2 chunks is
        # saved, keyed like the lookup would have, and none of the cached ones
        new = SimpleNamespace(
            req_id="r2", block_ids=([1, 2, 3, 4, 5, 6, 7],), num_computed_tokens=2 * C
        )
        out = output(new=[new])
        out.num_scheduled_tokens = {"r2": len(tokens) - 2 * C}
        want = kvc.fingerprints(make_ns("float32"), tokens[: 3 * C])
        assert saved(s2.build_connector_meta(out)) == [(2, want[2], [5, 6])]
        s.shutdown()
        s2.shutdown()
    finally:
        hole.close()


def test_a_lookup_not_waited_for_still_tells_the_save_what_is_stored(
    stored: tuple[KVCloud, list[int]],
) -> None:
    kvc, tokens = stored  # chunks 0-3 stored; the prompt is 4 C + 5 tokens
    s = side(kvc)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 4 * C) == (0, False)
    s._pending["r1"].future.result(timeout=5)  # the lookup is back by the end of the step
    # vLLM's own hit was only chunk 0 (say it evicted the rest after asking): the index
    # said chunks 0-3 are stored, so none is saved again
    new = SimpleNamespace(req_id="r1", block_ids=(list(range(1, 11)),), num_computed_tokens=C)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": len(tokens) - C}
    assert saved(s.build_connector_meta(out)) == []
    stats = s.take_stats()
    assert stats["lookups_not_waited"] == 1 and "lookups" not in stats


def test_a_short_prompt_vllm_holds_still_saves_its_answer(
    stored: tuple[KVCloud, list[int]],
) -> None:
    """A prompt shorter than a chunk whose blocks vLLM's own cache holds is scheduled
    without waiting for the index; the chunk its answer fills is still saved (it was
    skipped: no prompt chunk and no index answer read as "not kvcloud's request")."""
    kvc, _ = stored
    s = side(kvc)
    tokens = [int(t) for t in make_tokens(C - 4, seed=5)]  # 12 tokens: no full chunk
    busy = threading.Event()  # the lookup threads are all busy: its lookup is not back
    for _ in range(4):
        s._lookups.submit(busy.wait, 10)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, BS) == (0, False)  # block 0 is vLLM's own
    assert s.take_stats()["lookups_not_waited"] == 1
    new = SimpleNamespace(req_id="r1", block_ids=([3, 4],), num_computed_tokens=BS)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": len(tokens) - BS}
    assert saved(s.build_connector_meta(out)) == []
    answer = [int(t) for t in make_tokens(4, seed=9)]
    for t in answer[:3]:
        req.all_token_ids.append(t)
        step = output(cached=[("r1", None, len(req.all_token_ids) - 1, 1)])
        assert saved(s.build_connector_meta(step)) == []
    req.all_token_ids.append(answer[3])  # token C-1: the chunk is whole
    step = output(cached=[("r1", None, len(req.all_token_ids) - 1, 1)])
    want_fp = kvc.fingerprints(make_ns("float32"), tokens + answer)[0]
    assert saved(s.build_connector_meta(step)) == [(0, want_fp, [3, 4])]
    busy.set()
    s.shutdown()


def test_a_slow_lookup_counts_its_time_and_the_steps_it_deferred(
    stored: tuple[KVCloud, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lookup_us`` is the time from the request's arrival to the index's answer: what a
    load benchmark reads to tell a deferred request's cause (a slow index, a starved
    lookup thread) from its cost."""
    kvc, tokens = stored
    real = kvc.lookup_fingerprints

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.08)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvc, "lookup_fingerprints", slow)
    s = side(kvc)  # waits 20 ms at the first ask
    assert ask(s, request("r0", tokens)) == 4 * C
    stats = s.take_stats()
    assert stats["lookups"] == 1 and stats["lookup_deferrals"] >= 1
    assert 80_000 <= stats["lookup_us"] < 2_000_000, stats["lookup_us"]
    # a fast one: counted too, far below the slow one
    monkeypatch.setattr(kvc, "lookup_fingerprints", real)
    assert ask(s, request("r1", tokens)) == 4 * C
    assert 0 < s.take_stats()["lookup_us"] < 80_000
    s.shutdown()


def test_adapter_digests_and_remembered_bad_objects_stay_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server up for weeks sees adapters re-pointed and objects go bad: the digest cache
    keeps the newest ``_ADAPTERS_KEPT`` (a digest evicted is computed again, the same),
    and the worker forgets bad objects whose memory ran out."""
    from kvcloud.integrations.vllm import keys

    monkeypatch.setattr(keys, "_ADAPTERS_KEPT", 3)
    monkeypatch.setattr(keys, "_adapter_digests", {})
    digests = []
    for i in range(5):
        folder = tmp_path / f"a{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"w%d" % i)
        digests.append(keys.adapter_digest(str(folder)))
    assert len(keys._adapter_digests) == 3
    assert keys.adapter_digest(str(tmp_path / "a0")) == digests[0]  # computed again
    assert len(set(digests)) == 5

    from kvcloud.integrations.vllm.expiring import Expiring
    from kvcloud.integrations.vllm.loads import Restores

    r = Restores.__new__(Restores)
    now = [0.0]
    r._clock = lambda: now[0]
    r.cfg = VLLMConnectorConfig(failure_memory=60.0)
    r._meta_lock = threading.Lock()
    r._bad_objects, r._new_bad = Expiring(), {}
    for i in range(5000):
        now[0] = float(i)  # each remembered for 60 s: most have expired by the last
        r._remember_bad(f"key{i}")
    assert len(r._bad_objects) <= 4097
    assert r._is_bad("key4999") and not r._is_bad("key0")


def test_with_a_drafter_the_last_block_of_a_hit_on_a_chunk_boundary_is_computed(
    stored: tuple[KVCloud, list[int]],
) -> None:
    """An EAGLE drafter's KV at a position is computed from the token after it: at a
    chunk's last position that token is not covered by the chunk's key (another prompt
    stored it), so a hit ending on a chunk boundary leaves its last block to vLLM (as vLLM
    drops the last block of its own prefix hit for EAGLE). One ending inside a chunk
    needs no cut: the next token is in the chunk."""
    from kvcloud.integrations.vllm.scheduler import SchedulerSide

    kvc, tokens = stored
    config = VLLMConnectorConfig(chunk_tokens=C)
    s = SchedulerSide(config, make_ns("float32"), kvc, BS, drafter=True)
    req = request("d1", tokens)  # 4 stored chunks, then 5 more tokens
    s.on_new_request(req)
    assert ask(s, req) == 4 * C - BS
    exact = request("d2", tokens[: 4 * C])  # the hit is cut at the last block anyway
    s.on_new_request(exact)
    assert ask(s, exact) == 4 * C - BS
    plain = side(kvc)
    req = request("p1", tokens)
    plain.on_new_request(req)
    assert ask(plain, req) == 4 * C
