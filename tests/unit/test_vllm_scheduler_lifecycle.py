"""The scheduler side at the seams of a request's life, each case a defect issue 40 found
(each fails on the code before that issue; checked against vLLM 0.32's scheduler):

- a request resumed after a preemption under vLLM's V2 model runner arrives as a *new*
  request (``scheduled_new_reqs``, ``resumed_req_ids`` empty): its saves must name its new
  blocks, never the freed ones (they belong to other requests, maybe other tenants);
- an asynchronous restore that fails from its first block makes vLLM ask again before the
  request was ever scheduled: the same chunks must not be offered again (a loop of full
  pulls); the request recomputes and its chunks are saved again;
- a restore that fails part of the way: the chunks from the failure on are saved again as
  they are recomputed;
- a request scheduled before its lookup was back: the chunks vLLM's own cache held are
  saved once the lookup says the index lacks them (they were "taken as stored");
- a burst of new requests against a slow index: one ``lookup_wait_ms`` per scheduler
  step, not one per request;
- nothing the scheduler side cannot plan leaves a request waiting forever.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from kvcloud import KVCloud
from kvcloud.integrations.vllm.scheduler import SchedulerSide
from kvcloud.integrations.vllm.specs import KVCloudWorkerMeta
from tests.helpers import make_kv, make_ns, make_tokens
from tests.unit.test_vllm_scheduler import (
    BS,
    Blackhole,
    Blocks,
    C,
    ask,
    hung_index_client,
    output,
    request,
    saved,
    side,
)


def scheduled_new(rid: str, blocks: list[int], computed: int, n: int) -> SimpleNamespace:
    """A SchedulerOutput scheduling one request as new (vLLM's V2 runner sends a resumed
    request this way too)."""
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
    out = output(new=[new])
    out.num_scheduled_tokens = {rid: n}
    return out


def fresh(tmp_path: Path) -> KVCloud:
    return KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")


def held_lookups(s: SchedulerSide) -> threading.Event:
    """Hold every lookup of ``s`` at the index until the returned event is set, so a test
    can schedule a request before its lookup answers, with certainty."""
    gate = threading.Event()
    real = s._lookup_plan

    def held(*args: object) -> object:
        gate.wait(10)
        return real(*args)  # type: ignore[arg-type]

    s._lookup_plan = held  # type: ignore[method-assign]
    return gate


def test_v2_resumed_request_saves_from_its_new_blocks(tmp_path: Path) -> None:
    kvc = fresh(tmp_path)
    s = side(kvc, save_decode=False)
    tokens = [int(t) for t in make_tokens(4 * C + 3)]
    req = request("r1", tokens)
    assert ask(s, req) == 0
    # chunked prefill: the first step computes chunk 0 and half of chunk 1, in blocks 10-13
    old = [10, 11, 12, 13]
    assert [
        p for p, _, _ in saved(s.build_connector_meta(scheduled_new("r1", old, 0, C + BS)))
    ] == [0]
    # preempted (its blocks freed, given to others), then resumed: under the V2 runner it
    # arrives among the new requests with all-new blocks and no resumed flag
    assert ask(s, req) == 0
    new_blocks = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    got = saved(s.build_connector_meta(scheduled_new("r1", new_blocks, 0, 4 * C + 3)))
    # chunk 0 was handed over before; chunks 1-3 come from the new blocks, none from 10-13
    assert [(p, ids) for p, _, ids in got] == [(1, [32, 33]), (2, [34, 35]), (3, [36, 37])]
    s.shutdown()
    kvc.close()


def test_v1_resumed_request_saves_from_its_new_blocks(tmp_path: Path) -> None:
    kvc = fresh(tmp_path)
    s = side(kvc, save_decode=False)
    tokens = [int(t) for t in make_tokens(4 * C + 3)]
    req = request("r1", tokens)
    assert ask(s, req) == 0
    s.build_connector_meta(scheduled_new("r1", [10, 11, 12, 13], 0, C + BS))
    assert ask(s, req) == 0
    again = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    out = output(cached=[("r1", again, 0, 4 * C + 3)], resumed={"r1"})
    got = saved(s.build_connector_meta(out))
    assert [(p, ids) for p, _, ids in got] == [(1, [32, 33]), (2, [34, 35]), (3, [36, 37])]
    s.shutdown()
    kvc.close()


def stored_prompt(tmp_path: Path) -> tuple[KVCloud, list[int]]:
    kvc = fresh(tmp_path)
    tokens = [int(t) for t in make_tokens(4 * C + 5)]
    ns = make_ns("float32")
    kvc.push(ns, tokens[: 4 * C], make_kv(ns, 4 * C))
    return kvc, tokens


def test_a_restore_failed_from_its_first_block_is_not_offered_again(tmp_path: Path) -> None:
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C  # offered beside the pass (no rate known yet)
    s.update_state_after_alloc(req, Blocks(list(range(20, 29))), 4 * C)
    meta = s.build_connector_meta(output())
    assert [ld.req_id for ld in meta.loads] == ["r1"]
    # the worker failed every block (chunk 0 corrupt or gone); vLLM frees the blocks and,
    # the request having no computed tokens, asks again: answered at once, nothing offered
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.take_stats()["loads_failed_recomputed"] == 1
    # recomputed from scratch: every chunk is saved again from its new blocks
    blocks = list(range(40, 49))
    got = saved(s.build_connector_meta(scheduled_new("r1", blocks, 0, len(tokens))))
    assert [p for p, _, _ in got] == [0, 1, 2, 3]
    # and a later request for the same prompt is offered the chunks again (the bad objects
    # are the worker's to report; the index decides)
    req2 = request("r2", tokens)
    s.on_new_request(req2)
    assert ask(s, req2) == 4 * C
    s.shutdown()
    kvc.close()


def test_a_restore_failed_part_of_the_way_saves_the_rest_again(tmp_path: Path) -> None:
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc, save_decode=False)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C
    blocks = list(range(20, 29))
    s.update_state_after_alloc(req, Blocks(blocks), 4 * C)
    s.build_connector_meta(output())
    # chunks 0-1 loaded, chunk 2 failed: vLLM schedules the request from 2 chunks computed
    got = saved(s.build_connector_meta(scheduled_new("r1", blocks, 2 * C, len(tokens) - 2 * C)))
    assert [(p, ids) for p, _, ids in got] == [(2, [24, 25]), (3, [26, 27])]
    s.shutdown()
    kvc.close()


def test_a_restore_in_the_step_failed_part_of_the_way_saves_the_rest_again(
    tmp_path: Path,
) -> None:
    """A restore in the step (``sync``) fails at chunk 2: vLLM takes the request's computed
    tokens back to that block (``_update_requests_with_invalid_blocks``) and recomputes from
    there into the same blocks; the chunks from the failure on are saved as they are
    recomputed (their objects' entries were dropped by the pull: nobody else saves them)."""
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc, save_decode=False, load_mode="sync")
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req, sync=True) == 4 * C
    blocks = list(range(20, 29))
    s.update_state_after_alloc(req, Blocks(blocks), 4 * C)
    # the step restores chunks 0-3 and computes the last 5 tokens: nothing to save
    step = s.build_connector_meta(scheduled_new("r1", blocks, 4 * C, len(tokens) - 4 * C))
    assert [ld.req_id for ld in step.loads] == ["r1"] and saved(step) == []
    # blocks 24.. failed: vLLM's next step recomputes from 2 chunks computed
    out = output(cached=[("r1", None, 2 * C, len(tokens) - 2 * C)])
    got = saved(s.build_connector_meta(out))
    assert [(p, ids) for p, _, ids in got] == [(2, [24, 25]), (3, [26, 27])]
    assert s.take_stats()["saves_rewound"] == 1
    # a request that went on as planned is not rewound
    req2 = request("r2", tokens)
    s.on_new_request(req2)
    assert ask(s, req2, sync=True) == 4 * C
    s.update_state_after_alloc(req2, Blocks(list(range(40, 49))), 4 * C)
    s.build_connector_meta(scheduled_new("r2", list(range(40, 49)), 4 * C, 5))
    assert saved(s.build_connector_meta(output(cached=[("r2", None, 4 * C + 5, 1)]))) == []
    assert "saves_rewound" not in s.take_stats()
    s.shutdown()
    kvc.close()


def test_chunks_taken_as_stored_are_saved_once_the_lookup_says_otherwise(tmp_path: Path) -> None:
    """vLLM's own cache held 3 chunks, so the request was scheduled without its lookup
    (held here until then, so the order is certain); only chunk 0 is in the index (say
    chunks 1-2's saves were lost): nothing is saved at scheduling, and once the lookup is
    back chunks 1 and 2 are saved from the request's blocks, chunk 0 is not."""
    kvc = fresh(tmp_path)
    ns = make_ns("float32")
    tokens = [int(t) for t in make_tokens(3 * C + 1)]
    kvc.push(ns, tokens[:C], make_kv(ns, C))
    s = side(kvc, save_decode=False)
    gate = held_lookups(s)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 3 * C) == (0, False)
    blocks = [1, 2, 3, 4, 5, 6, 7]
    assert saved(s.build_connector_meta(scheduled_new("r1", blocks, 3 * C, 1))) == []
    gate.set()
    s._saving["r1"].lookup.result(timeout=5)  # type: ignore[union-attr]
    got = saved(s.build_connector_meta(output(cached=[("r1", None, 3 * C + 1, 1)])))
    fps = kvc.fingerprints(ns, tokens[: 3 * C])
    assert got == [(1, fps[1], [3, 4]), (2, fps[2], [5, 6])]
    assert s.take_stats()["chunks_backfilled"] == 2
    # once only
    assert saved(s.build_connector_meta(output(cached=[("r1", None, 3 * C + 2, 1)]))) == []
    s.shutdown()
    kvc.close()


def test_a_burst_of_new_requests_shares_one_lookup_wait_per_step(tmp_path: Path) -> None:
    hole = Blackhole()
    try:
        kvc = hung_index_client(tmp_path, hole)
        wait_ms = 400
        s = side(kvc, lookup_wait_ms=wait_ms, lookup_timeout=30.0, breaker_failures=100)
        tokens = [int(t) for t in make_tokens(4 * C + 5)]
        reqs = [request(f"r{i}", tokens) for i in range(24)]
        for r in reqs:
            s.on_new_request(r)
        # one schedule() pass asks about every waiting request
        t0 = time.monotonic()
        answers = [s.get_num_new_matched_tokens(r, 0) for r in reqs]
        took = time.monotonic() - t0
        assert answers == [(None, False)] * len(reqs)  # all deferred: the index is hung
        # one budget for the pass: 0.4 s, not 24 × 0.4 s (the code before waited per request)
        assert took < 5 * wait_ms / 1000, f"the pass took {took:.2f} s"
        s.build_connector_meta(output())  # the step ends; the next pass has a budget again
        t0 = time.monotonic()
        late = request("late", tokens)
        s.on_new_request(late)
        assert s.get_num_new_matched_tokens(late, 0) == (None, False)
        assert time.monotonic() - t0 >= 0.9 * wait_ms / 1000  # it did wait its budget
        s.shutdown()
    finally:
        hole.close()


def test_a_load_the_scheduler_could_not_plan_is_reported_failed(tmp_path: Path) -> None:
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C
    s.load_unplanned(req, Blocks(list(range(20, 29))), 4 * C)
    meta = s.build_connector_meta(output())
    (spec,) = meta.loads
    assert spec.refused and [b for ch in spec.chunks for b in ch.block_ids] == list(range(20, 28))
    # a step whose metadata failed to build still sends each pending load, refused
    s2 = side(kvc)
    req2 = request("r2", tokens)
    s2.on_new_request(req2)
    assert ask(s2, req2) == 4 * C
    s2.update_state_after_alloc(req2, Blocks(list(range(50, 59))), 4 * C)
    (spec2,) = s2.failed_step().loads
    assert spec2.refused and spec2.req_id == "r2"
    assert [b for ch in spec2.chunks for b in ch.block_ids] == list(range(50, 58))
    assert s2.build_connector_meta(output()).loads == []  # sent once
    s.shutdown()
    s2.shutdown()
    kvc.close()


def test_a_lora_folder_removed_after_the_lookup_never_raises(tmp_path: Path) -> None:
    """A request scheduled while its lookup is out (a hung index) has its plan made on
    vLLM's thread; its LoRA adapter's folder removed meanwhile, the request runs without
    kvcloud, counted: nothing raises into vLLM (the code before raised SkipRequest out of
    build_connector_meta, which stops the engine)."""
    hole = Blackhole()
    try:
        kvc = hung_index_client(tmp_path, hole)
        s = side(kvc, lookup_timeout=30.0)
        folder = tmp_path / "adapter"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
        lora = SimpleNamespace(lora_name="a", lora_path=str(folder), lora_int_id=1)
        tokens = [int(t) for t in make_tokens(2 * C + 1)]
        req = request("r1", tokens, lora_request=lora)
        s.on_new_request(req)
        assert s.get_num_new_matched_tokens(req, 2 * C) == (0, False)  # vLLM holds it all
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        meta = s.build_connector_meta(scheduled_new("r1", [1, 2, 3, 4, 5], 2 * C, 1))
        assert meta.saves == []
        # (counted once more if the lookup thread, behind on a busy machine, reaches the
        # vanished folder after the plan was made)
        assert s.take_stats()["requests_skipped"] >= 1
    finally:
        hole.close()
    # the lookup thread, freed by the closed hole, logs its skip: let it finish inside the
    # test (after it, pytest's capture stream is closed and the log line is a logging error)
    s._lookups.shutdown(wait=True)
    s.shutdown()


def test_bad_objects_reported_by_the_worker_stop_offers(tmp_path: Path) -> None:
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc)
    req = request("r1", tokens)
    assert ask(s, req) == 4 * C
    first = s._plans["r1"].match.chunks[0].entry.object_key  # type: ignore[union-attr]
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KVCloudWorkerMeta({first: 60.0}))
    )
    req2 = request("r2", tokens)
    assert ask(s, req2) == 0
    s.shutdown()
    kvc.close()


def test_a_failure_naming_the_saves_never_loses_the_steps_loads(tmp_path: Path) -> None:
    """The loads of a step go out even when naming its saves raises: vLLM counts an in-step
    restore's tokens as computed and waits for one beside the pass."""
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C
    s.update_state_after_alloc(req, Blocks(list(range(20, 29))), 4 * C)

    def broken(*args: object) -> None:
        raise RuntimeError("a bug naming saves")

    s._unwaited_plan = broken  # type: ignore[method-assign]
    meta = s.build_connector_meta(scheduled_new("r9", [1, 2], 0, C))
    assert [ld.req_id for ld in meta.loads] == ["r1"] and meta.saves == []
    assert s.take_stats()["connector_errors"] == 1
    s.shutdown()
    kvc.close()


def test_a_lookup_queued_behind_a_burst_does_not_blame_the_index(tmp_path: Path) -> None:
    """Lookups queued on the scheduler's own threads past ``lookup_timeout`` are misses for
    their requests, but the index answered every lookup it was sent: its breaker stays
    closed (the code before opened it, and every later request missed)."""
    kvc, tokens = stored_prompt(tmp_path)
    s = side(kvc, lookup_timeout=0.3, lookup_wait_ms=0)
    busy = threading.Event()
    for _ in range(4):  # every lookup thread held: the next lookup waits in the queue
        s._lookups.submit(busy.wait, 30)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.4)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # a miss for this request
    stats = s.take_stats()
    assert stats["lookup_timeouts"] == 1 and stats["lookup_queue_timeouts"] == 1
    assert not s.index_breaker.is_open
    busy.set()
    req2 = request("r2", tokens)
    s.on_new_request(req2)
    assert ask(s, req2) == 4 * C  # the index still serves
    s.shutdown()
    kvc.close()


def test_no_backfill_from_blocks_not_yet_recomputed(tmp_path: Path) -> None:
    """A request resumed before its late lookup answered has new blocks that hold nothing
    of the chunks vLLM's cache held: nothing is backfilled from them."""
    kvc = fresh(tmp_path)
    ns = make_ns("float32")
    tokens = [int(t) for t in make_tokens(3 * C + 1)]
    s = side(kvc, save_decode=False)
    gate = held_lookups(s)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 3 * C) == (0, False)
    s.build_connector_meta(scheduled_new("r1", [1, 2, 3, 4, 5, 6, 7], 3 * C, 1))
    # preempted and resumed (V2: as new) with all-new blocks; its first step computes chunk 0
    got = saved(s.build_connector_meta(scheduled_new("r1", [30, 31, 32, 33, 34, 35, 36], 0, C)))
    assert got == []  # the lookup is still out: chunks 0-2 are of unknown state
    gate.set()
    s._saving["r1"].lookup.result(timeout=5)  # type: ignore[union-attr]
    later = saved(s.build_connector_meta(output(cached=[("r1", None, C, C)])))
    fps = kvc.fingerprints(ns, tokens[: 3 * C])
    # the index holds none of them: chunks 0 and 1 (computed by now) are named from the
    # new blocks, chunk 2 when it is recomputed, never from blocks not yet recomputed
    assert later == [(0, fps[0], [30, 31]), (1, fps[1], [32, 33])]
    last = saved(s.build_connector_meta(output(cached=[("r1", None, 2 * C, C + 1)])))
    assert last == [(2, fps[2], [34, 35])]
    s.shutdown()
    kvc.close()
