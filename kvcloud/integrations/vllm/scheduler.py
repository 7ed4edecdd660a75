"""Scheduler side: decide what each request loads from kvcloud and which chunks it pushes.

Tensor-free, and it never waits on the network for more than ``lookup_wait_ms`` per step
(a slow index never stalls the engine):

- **Lookups run on their own threads** (lookups.py), waited for within one
  ``lookup_wait_ms`` per scheduler step; one still out is asked about again at the next
  step while vLLM schedules every other request.
- **A circuit breaker on the index.** Consecutive failed or timed-out lookups open it; while
  it is open no request touches the index (a miss at once), until one probe succeeds.
- **Loads run in the step only when they are short** (``load_mode=auto``, the default): a
  load the workers' measured restore rate says will take at most ``sync_budget_ms`` runs in
  the step that schedules the request; any other (and every one while no rate is known) is
  asynchronous (``load_kv_async``): the request waits in vLLM's WAITING_FOR_REMOTE_KVS state
  while its chunks are pulled, verified and written into its blocks off the forward pass,
  and the requests already running keep decoding. ``load_mode=async`` and ``sync`` make
  every load one or the other. A store
  the workers report as failing (their own breaker) gets no loads offered, and objects whose
  pull failed or timed out are not offered again for ``failure_memory`` seconds.
- **Saves follow the request's KV as it is computed**: each step names the chunks whose last
  token's KV that step computes, prompt chunks during the prefill and (``save_decode``) the
  chunks the answer fills while decoding, which in a chat are the next turn's prompt
  (saves.py).

A request's life, as vLLM's calls move it: looked up (``on_new_request``) → planned (its
hit, ``get_num_new_matched_tokens``) → loading (``update_state_after_alloc``: vLLM gave it
blocks for the hit) → running and saving (scheduled: ``build_connector_meta``) → finished
(``request_finished``). The seams, each tested (tests/unit/test_vllm_scheduler_lifecycle.py):

- vLLM asks again for a request it never scheduled only after its load failed from the first
  block (vLLM freed the blocks): the same offer would fail the same way, so it recomputes;
- a request resumed after a preemption comes back with all-new blocks, flagged resumed
  (``resumed_req_ids``) under vLLM's V1 model runner, as a *new* request under the V2 runner
  GPUs use: either way its saves switch to the new block ids (the old ones are other
  requests' now), and the chunks it already handed over are not saved twice;
- a request scheduled before its lookup was back (vLLM's own cache held every block the hit
  could cover) saves the chunks beyond vLLM's cache at once, and those vLLM's cache held
  that the index lacks once the lookup answers, from the request's blocks;
- a load that failed part of the way is recomputed by vLLM from the first failed block, and
  the chunks from there are saved again.

The hit offered to vLLM is the run of stored chunks beyond vLLM's own prefix-cache hit, cut
at the last vLLM block before the prompt's final token (vLLM must compute at least one token
to sample from). Keys cover everything vLLM's own block hash covers (keys.request_scope); a
request kvcloud cannot key runs without it, counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any

from ...client import KVCloud
from ...namespace import Namespace
from . import cost
from .config import VLLMConnectorConfig
from .expiring import Expiring
from .lookups import Lookups, Pending, Plan
from .saves import SaveNaming, Saving, more_groups, per_group
from .specs import NULL_BLOCK, KVCloudWorkerMeta, LoadChunk, LoadSpec, StepSpec, whole_failures
from .stats import SideStats

log = logging.getLogger("vllm.kvcloud")


class SchedulerSide(Lookups, SaveNaming):
    def __init__(
        self,
        cfg: VLLMConnectorConfig,
        ns: Namespace,
        client: KVCloud,
        block_size: int,
        clock: Any = time.monotonic,
        windows: list[int | None] | None = None,
        drafter: bool = False,
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        self.client = client
        self.block_size = block_size
        # per KV cache group (several with vLLM's hybrid allocator), its sliding window or
        # None. A sliding group's blocks behind the window are freed and reused, so only a
        # chunk's own step may read them (no backfill of older chunks), and only while the
        # window still covers them (_freed)
        self.windows = list(windows) if windows else [None]
        self.sliding = any(w is not None for w in self.windows)
        self.whole_failures = whole_failures(self.windows)
        if self.whole_failures and cfg.load_mode == "sync":
            log.warning(
                "kvcloud: load_mode=sync with a sliding window or several KV cache groups: "
                "restores run beside the pass (a failed one is recomputed whole, which one "
                "in the step cannot be)"
            )
        # an EAGLE/MTP drafter's KV at a position is computed from the token after it: at
        # the last position of a chunk that token lies beyond the chunk's fingerprint (as
        # vLLM drops the last block of its own prefix hit for EAGLE, for the same reason)
        self.drafter = drafter
        self._clock = clock
        self._plans: dict[str, Plan] = {}
        self._pending: dict[str, Pending] = {}
        self._loads: dict[str, Plan] = {}  # offered and allocated, not yet in metadata
        self._unplanned: dict[str, LoadSpec] = {}  # allocated loads that failed to plan
        self._saving: dict[str, Saving] = {}
        self._requests: dict[str, Any] = {}  # vLLM's Request of each request seen, for saves
        self._stats = SideStats()  # lookup threads report too
        self.index_breaker = cfg.breaker("index", clock, self._breaker_changed)
        self._lookups = cf.ThreadPoolExecutor(4, thread_name_prefix="kvcloud-lookup")
        # what the workers report: objects not to offer, and until when the store is out
        self._bad_objects = Expiring()
        self._store_out_until = 0.0
        self._scheduler_ns = 0  # time spent in this class's calls on vLLM's thread
        # bytes per second of the workers' restores, in the step and beside it (moving
        # averages; None until one is measured): what load_mode=auto predicts from
        self._rate_in_step: float | None = None
        self._rate_beside: float | None = None
        # tokens per second of the workers' forward passes (None until measured), and when
        # a hit may next load its first chunk although the guard would skip it (cost.py)
        self._prefill_rate: float | None = None
        self._next_probe = 0.0
        # what is left of lookup_wait_ms in this scheduler step: vLLM asks about every
        # waiting request in one schedule() pass, so a burst of new requests against a slow
        # index would otherwise block the pass (and every running decode) N waits long
        self._wait_left = cfg.lookup_wait_ms / 1000

    def count(self, **deltas: int) -> None:
        self._stats.count(**deltas)

    def observe(self, name: str, value: float) -> None:
        """One observation for the histogram ``name`` (metadata.HISTOGRAMS)."""
        self._stats.observe(name, value)

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            self.count(index_breaker_opened=1)

    def _usable_chunks(self, plan: Plan) -> int:
        """Leading chunks of the hit that may be offered: the store is up and none of them is
        an object a worker recently failed to pull."""
        if plan.match is None or not plan.match.chunks:
            return 0
        now = self._clock()
        if now < self._store_out_until:
            self.count(loads_skipped=1)
            return 0
        n = 0
        for ref in plan.match.chunks:
            if self._bad_objects.holds(ref.entry.object_key, now):
                break
            n += 1
        return n

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter_ns()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self._scheduler_ns += time.perf_counter_ns() - t0

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not request.prompt_token_ids:
            return 0, False
        # vLLM must compute at least the prompt's last token to sample from it. The hit ends
        # on a vLLM block boundary: of the last stored chunk it reaches, only the blocks
        # before that token are loaded (the object is pulled and verified whole), so a
        # prompt that is an exact multiple of the chunk recomputes one block, not one chunk.
        last_block = (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        rid = request.request_id
        if num_computed_tokens >= last_block and rid not in self._plans:
            # vLLM's own cache holds every block kvcloud could offer: the lookup cannot
            # change the answer, so vLLM does not wait for it (a shared prefix served
            # locally costs no index round trip on the scheduler's thread). What it says
            # about stored chunks is still used for the saves if it is back by then.
            self.count(lookups_not_waited=1)
            return 0, False
        plan = self._resolve(request)
        if plan is None:
            return None, False
        if plan.offered:
            # asked again before it was ever scheduled: its load failed from the first block
            # (vLLM freed the blocks and starts over). Offering the same chunks again would
            # fail the same way, one full pull per round, forever: recompute, and save what
            # is recomputed (the index's entries for the bad objects are dropped by the pull)
            self.count(loads_failed_recomputed=1)
            plan.match, plan.offered, plan.stored = None, False, 0
            return 0, False
        usable = self._usable_chunks(plan)
        if usable == 0:
            return 0, False
        hit = min(usable * self.ns.chunk_tokens, last_block)
        if self.drafter and hit == usable * self.ns.chunk_tokens:
            # the hit ends where the stored chunks do: the token after it is not under any
            # chunk's key, so its last block's draft KV is recomputed (see __init__)
            hit -= self.block_size
        hit = self._paying(plan, num_computed_tokens, hit)
        external = hit - num_computed_tokens
        if external <= 0 or external < self.cfg.min_hit_tokens:
            return 0, False
        plan.local, plan.external = num_computed_tokens, external
        # with a sliding group (or several groups) vLLM hears of a failed restore only as a
        # whole request waiting for it (WorkerSide.whole_failures): beside the pass
        plan.sync = self._in_step(plan, hit) if not self.whole_failures else False
        return external, not plan.sync

    def _paying(self, plan: Plan, local: int, hit: int) -> int:
        """The end of the part of the hit ``[local, hit)`` that restoring pays for
        (cost.py): all of it until the rates are measured or with ``cost_margin`` 0."""
        restore = self._rate_beside if self._rate_beside is not None else self._rate_in_step
        if self.cfg.cost_margin <= 0 or self._prefill_rate is None or restore is None:
            return hit
        if hit <= local:
            return hit
        assert plan.match is not None
        c = self.ns.chunk_tokens
        sizes = [(ref.position, ref.entry.size) for ref in plan.match.chunks]
        end = cost.paying_end(
            local, hit, c, sizes, self._prefill_rate, restore, self.cfg.cost_margin
        )
        if end >= hit:
            return hit
        now = self._clock()
        if end <= local and now >= self._next_probe:
            # nothing pays: one hit now and then still loads a chunk, so a store that got
            # faster is measured again (no restore runs otherwise)
            self._next_probe = now + self.cfg.cost_reprobe_s
            self.count(cost_probes=1)
            return cost.first_chunk_end(local, hit, c)
        self.count(hits_skipped_by_cost=1, hit_tokens_skipped_by_cost=hit - end)
        return end

    def _in_step(self, plan: Plan, end: int) -> bool:
        """Whether the load runs in the step (vLLM is told ``load_async=False``). ``auto``:
        when the objects it pulls are expected to take at most ``sync_budget_ms`` at the
        rate restores in the step have run; before one has, at twice the rate of those
        beside the pass (they share the cores with it; the worker abandons an in-step
        restore past four budgets, so a wrong guess costs the batch a bounded stall). With
        no rate known yet, beside the pass: that is how the first rate is learnt."""
        if self.cfg.load_mode != "auto":
            return self.cfg.load_mode == "sync"
        if self._rate_in_step is not None:
            rate = self._rate_in_step
        elif self._rate_beside is not None:
            rate = 2 * self._rate_beside
        else:
            return False
        if rate <= 0:  # a store that delivered nothing in its last restore (cost.capped)
            return False
        pulled = sum(ref.entry.size for ref in self._pulled(plan, end))
        return 1000 * pulled / rate <= self.cfg.sync_budget_ms

    def _pulled(self, plan: Plan, end: int) -> list[Any]:
        """The matched chunks a load of tokens [plan.local, end) pulls: those overlapping
        it. The budget decision and the load spec both use this, so the bytes priced are
        the bytes pulled."""
        assert plan.match is not None
        c = self.ns.chunk_tokens
        return [
            ref
            for ref in plan.match.chunks
            if (ref.position + 1) * c > plan.local and ref.position * c < end
        ]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or num_external_tokens <= 0 or plan.external <= 0:
            return
        # vLLM may trim an offer from its end (to a block boundary): load exactly the
        # blocks it now expects us to fill, and none that it will compute itself
        plan.external = min(plan.external, num_external_tokens)
        plan.block_ids = per_group(blocks.get_block_ids())
        plan.offered = True
        self._loads[request.request_id] = plan
        self.count(hit_tokens=plan.external)
        if plan.sync:
            self.count(loads_in_step=1)

    def _refused_spec(
        self, req_id: str, ids: list[list[int]], local: int, external: int, sync: bool
    ) -> LoadSpec:
        """A load that pulls nothing: the worker reports the blocks holding tokens
        [local, local + external) failed at once (the whole request, with several KV cache
        groups), and vLLM recomputes them."""
        bs = self.block_size
        part = [g[local // bs : (local + external) // bs] for g in ids] or [[]]
        chunk = LoadChunk(-1, b"", b"", "", 0, part[0], part if len(part) > 1 else [])
        return LoadSpec(req_id, "", [chunk], sync, refused=True)

    def load_unplanned(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a load this side could not plan (a bug): refused."""
        rid = request.request_id
        plan = self._plans.get(rid)
        self._unplanned[rid] = self._refused_spec(
            rid,
            per_group(blocks.get_block_ids()),
            plan.local if plan is not None else 0,
            max(0, num_external_tokens),
            plan.sync if plan is not None else False,
        )

    def failed_step(self) -> StepSpec:
        """What a step whose metadata could not be built still sends: each load vLLM
        expects, refused (reported failed: recomputed), so no request waits for it."""
        meta = StepSpec()
        for req_id, plan in self._loads.items():
            spec = self._refused_spec(req_id, plan.block_ids, plan.local, plan.external, plan.sync)
            meta.loads.append(spec)
        meta.loads.extend(self._unplanned.values())
        self._loads.clear()
        self._unplanned.clear()
        return meta

    # -- metadata ---------------------------------------------------------------------------

    def _load_spec(self, req_id: str, plan: Plan) -> LoadSpec:
        assert plan.match is not None
        c, bs = self.ns.chunk_tokens, self.block_size
        per_chunk = c // bs
        first_block = plan.local // bs
        end = plan.local + plan.external
        end_block = end // bs
        chunks = []
        for ref in self._pulled(plan, end):
            base = ref.position * per_chunk
            ids = [
                [
                    group[base + k] if first_block <= base + k < end_block else -1
                    for k in range(per_chunk)
                ]
                for group in plan.block_ids
            ]
            if all(b < 0 or b == NULL_BLOCK for g in ids for b in g):
                continue  # out of every group's window: nothing of it is needed
            key, size = ref.entry.object_key, ref.entry.size
            chunks.append(
                LoadChunk(ref.position, ref.fp, ref.parent, key, size, ids[0], more_groups(ids))
            )
        return LoadSpec(req_id, plan.tenant, chunks, sync=plan.sync)

    def build_connector_meta(self, scheduler_output: Any) -> StepSpec:
        t0 = time.perf_counter_ns()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self._scheduler_ns += time.perf_counter_ns() - t0

    def _build_meta(self, scheduler_output: Any) -> StepSpec:
        meta = StepSpec()
        # schedule() is over: the next one has a whole lookup_wait_ms again
        self._wait_left = self.cfg.lookup_wait_ms / 1000
        # every load vLLM allocated blocks for since the last step, whether the request is
        # new or resumed after a preemption (it waits for the load, not scheduled yet); the
        # pending loads are forgotten only once every spec is built (else failed_step
        # still sends them, refused)
        for req_id, plan in self._loads.items():
            spec = self._load_spec(req_id, plan)
            if spec.chunks or not spec.sync:
                # (an asynchronous load with nothing to pull is still reported finished,
                # or the request would wait for it forever; one in the step is just dropped:
                # the worker would report a RUNNING request's load finished)
                meta.loads.append(spec)
        meta.loads.extend(self._unplanned.values())
        self._loads.clear()
        self._unplanned.clear()
        try:
            self._step_saves(scheduler_output, meta)
        except Exception as exc:
            # the loads must go out whatever happens to the saves: vLLM counts their tokens
            # as computed (in the step) or waits for them (beside it); this step's saves
            # are lost, future misses
            log.warning("kvcloud: naming this step's saves failed: %s: %s",
                        type(exc).__name__, exc)  # fmt: skip
            self.count(connector_errors=1)
            meta.saves.clear()
        return meta

    # -- what the workers report ------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVCloudWorkerMeta):
            return
        now = self._clock()
        for key, seconds in meta.bad_objects.items():
            self._bad_objects.add(key, now + seconds, now)
        if meta.store_retry_in > 0:
            self._store_out_until = max(self._store_out_until, now + meta.store_retry_in)
        elif meta.store_ok:
            self._store_out_until = 0.0
        # bytes over summed seconds: restores that ran at the same time each count their own
        # time, so the rate is what one restore gets, not the store's total (the safe side
        # for a budget that one restore must fit)
        self._rate_in_step = cost.moved(self._rate_in_step, meta.in_step_bytes, meta.in_step_s)
        self._rate_beside = cost.moved(self._rate_beside, meta.beside_bytes, meta.beside_s)
        if meta.given_up_s:
            # restores given up at their timeout: what they got in that time (cost.py)
            gb, gs = meta.given_up_bytes, meta.given_up_s
            self._rate_in_step = cost.capped(self._rate_in_step, gb, gs)
            self._rate_beside = cost.capped(self._rate_beside, gb, gs)
        if meta.in_step_bytes or meta.beside_bytes or meta.given_up_s:
            self._next_probe = now + self.cfg.cost_reprobe_s  # measured: no probe needed
        self._prefill_rate = cost.moved(self._prefill_rate, meta.pass_tokens, meta.pass_s)

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._plans.pop(rid, None)
        self._pending.pop(rid, None)
        self._loads.pop(rid, None)
        self._saving.pop(rid, None)
        self._requests.pop(rid, None)

    def take_stats(self) -> dict[str, Any]:
        out = self._stats.take({"index_breaker_open": int(self.index_breaker.is_open)})
        if self._scheduler_ns:
            out["scheduler_us"] = self._scheduler_ns // 1000
            self._scheduler_ns = 0
        return out

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
