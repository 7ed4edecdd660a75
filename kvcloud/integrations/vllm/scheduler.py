"""Scheduler side: decide what each request loads from kvcloud and which chunks it pushes.

Tensor-free, and it never waits on the network for more than ``lookup_wait_ms`` per step
(DESIGN §4, invariant 7):

- **Lookups run on their own threads.** A request's lookup starts when vLLM first sees the
  request (``on_new_request``). When vLLM asks for its hit, the answer is usually there; if
  not, ``get_num_new_matched_tokens`` answers ``None`` ("ask again next step") and vLLM
  schedules every other request meanwhile. A lookup out longer than ``lookup_timeout`` is a
  miss for that request alone.
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
  chunks the answer fills while decoding, which in a chat are the next turn's prompt.

The hit offered to vLLM is the run of stored chunks beyond vLLM's own prefix-cache hit, cut
at the last vLLM block before the prompt's final token (vLLM must compute at least one token
to sample from). Keys cover everything vLLM's own block hash covers (keys.request_scope); a
request kvcloud cannot key runs without it, counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...client import KVCloud, Match
from ...namespace import Namespace
from .config import VLLMConnectorConfig
from .keys import SkipRequest, request_scope
from .specs import NULL_BLOCK, KVCloudWorkerMeta, LoadChunk, LoadSpec, SaveChunk, SaveSpec, StepSpec

log = logging.getLogger("vllm.kvcloud")


@dataclass
class _Plan:
    """A request's lookup: its prompt fingerprints and the kvcloud hit."""

    tenant: str
    fps: list[bytes]  # every full chunk of the prompt
    match: Match | None  # None: no hit (miss, failure, skipped)
    stored: int = 0  # leading chunks known stored without the index (match is None)
    skip: bool = False  # a request kvcloud cannot key: neither loaded nor saved
    local: int = 0  # vLLM's own hit when the load was offered
    external: int = 0  # tokens offered beyond it
    sync: bool = False  # the load runs in the step that schedules the request
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    """A lookup in flight."""

    future: cf.Future[_Plan]
    started: float
    asked: bool = False  # vLLM has asked for this request's hit before


@dataclass
class _Saving:
    """A request whose chunks are pushed as its steps complete them."""

    tenant: str
    fps: list[bytes]  # fingerprints of its full chunks known so far
    next_chunk: int
    block_ids: list[int] = field(default_factory=list)
    request: Any = None  # vLLM's Request: its tokens grow while it decodes (save_decode)


class SchedulerSide:
    def __init__(
        self,
        cfg: VLLMConnectorConfig,
        ns: Namespace,
        client: KVCloud,
        block_size: int,
        clock: Any = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        self.client = client
        self.block_size = block_size
        self._clock = clock
        self._plans: dict[str, _Plan] = {}
        self._pending: dict[str, _Pending] = {}
        self._loads: dict[str, _Plan] = {}  # offered and allocated, not yet in metadata
        self._saving: dict[str, _Saving] = {}
        self._requests: dict[str, Any] = {}  # vLLM's Request of each request seen, for saves
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()  # lookup threads count too
        self.index_breaker = cfg.breaker("index", clock, self._breaker_changed)
        self._lookups = cf.ThreadPoolExecutor(4, thread_name_prefix="kvcloud-lookup")
        # what the workers report: objects not to offer, and until when the store is out
        self._bad_objects: dict[str, float] = {}
        self._store_out_until = 0.0
        self._index_gauge = 0  # last value of the index_breaker_open gauge reported
        self._scheduler_ns = 0  # time spent in this class's calls on vLLM's thread
        # bytes per second of the workers' restores, in the step and beside it (moving
        # averages; None until one is measured): what load_mode=auto predicts from
        self._rate_in_step: float | None = None
        self._rate_beside: float | None = None

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            self.stats.update(deltas)

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            self.count(index_breaker_opened=1)

    # -- lookups ----------------------------------------------------------------------------

    def request_scope_of(self, request: Any) -> str:
        """The tenant a request's fingerprints are made with (keys.request_scope)."""
        return request_scope(self.cfg.tenant, request)

    def on_new_request(self, request: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._requests[request.request_id] = request
            if request.prompt_token_ids and request.request_id not in self._pending:
                self._start(request)
        finally:
            self._scheduler_ns += time.perf_counter_ns() - t0

    def _start(self, request: Any) -> _Plan | None:
        """Start the request's lookup; a plan at once when the index is not to be touched."""
        rid = request.request_id
        try:
            tenant = request_scope(self.cfg.tenant, request)
        except SkipRequest as exc:
            self.count(requests_skipped=1)
            log.info("kvcloud: request %s runs without kvcloud: %s", rid, exc)
            plan = self._plans[rid] = _Plan("", [], None, skip=True)
            return plan
        if not self.index_breaker.allow():
            self.count(lookups_skipped=1)
            # no hit, but the prompt is still saved (a few µs of hashing): the uploader has
            # a client of its own, and the index may be back before the push goes out
            fps = self.client.fingerprints(self.ns, list(request.prompt_token_ids), tenant)
            plan = self._plans[rid] = _Plan(tenant, fps, None)
            return plan
        tokens = list(request.prompt_token_ids)
        future = self._lookups.submit(self._lookup, rid, tenant, tokens, time.perf_counter_ns())
        self._pending[rid] = _Pending(future, self._clock())
        return None

    def _lookup(self, rid: str, tenant: str, tokens: list[int], submitted_ns: int) -> _Plan:
        """On a lookup thread: fingerprints, then one index round trip."""
        try:
            return self._lookup_plan(rid, tenant, tokens)
        finally:
            # from the request's arrival: a lookup queued behind others, or starved of the
            # CPU or the GIL by the forward pass, is what defers a request a step
            self.count(lookup_us=(time.perf_counter_ns() - submitted_ns) // 1000)

    def _lookup_plan(self, rid: str, tenant: str, tokens: list[int]) -> _Plan:
        t0 = time.perf_counter()
        fps = self.client.fingerprints(self.ns, tokens, tenant)
        try:
            # every full chunk: the hit decides what is loaded and what is already stored
            match = self.client.lookup_fingerprints(self.ns, fps, tenant=tenant, strict=True)
        except Exception as exc:  # any failure of the index is a miss, and counts
            self.count(lookup_errors=1)
            self.index_breaker.failure(type(exc).__name__)
            log.debug("lookup %s failed: %s", rid, exc)
            return _Plan(tenant, fps, None)
        self.index_breaker.success()
        log.debug(
            "lookup %s: %d of %d chunks in kvcloud (%.1f ms)",
            rid,
            len(match.chunks),
            len(fps),
            (time.perf_counter() - t0) * 1000,
        )
        return _Plan(tenant, fps, match)

    def _resolve(self, request: Any) -> _Plan | None:
        """The request's plan, or None while its lookup is still out (ask again later)."""
        rid = request.request_id
        plan = self._plans.get(rid)
        if plan is not None:
            return plan
        pending = self._pending.get(rid)
        if pending is None:
            plan = self._start(request)
            if plan is not None:
                return plan
            pending = self._pending[rid]
        # only the first ask waits (a healthy lookup answers well within it); later asks
        # just look, so a lookup stuck in a sick index costs each engine step nothing
        wait = 0.0 if pending.asked else self.cfg.lookup_wait_ms / 1000
        pending.asked = True
        try:
            plan = pending.future.result(timeout=wait)
        except cf.TimeoutError:
            waited = self._clock() - pending.started
            if waited < self.cfg.lookup_timeout and not self.index_breaker.is_open:
                self.count(lookup_deferrals=1)
                return None
            # too long, or the index went down meanwhile: this request runs as a miss
            self.count(lookup_timeouts=1)
            if waited >= self.cfg.lookup_timeout:
                self.index_breaker.failure("lookup timed out", timeout=True)
            plan = self._miss_plan(request)
        except Exception as exc:  # a bug in the lookup thread: a miss, never a failed request
            log.warning("kvcloud lookup for %s failed: %s", rid, exc)
            plan = self._miss_plan(request)
        self._pending.pop(rid, None)
        self.count(lookups=1)
        self._plans[rid] = plan
        return plan

    def _miss_plan(self, request: Any) -> _Plan:
        """A request served as a miss without the index's answer: nothing is loaded, but
        its chunks (prompt, and answer as the decode fills them) are still saved; the
        uploader skips those already indexed."""
        tenant = request_scope(self.cfg.tenant, request)  # it passed in _start already
        fps = self.client.fingerprints(self.ns, list(request.prompt_token_ids), tenant)
        return _Plan(tenant, fps, None)

    def _usable_chunks(self, plan: _Plan) -> int:
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
            until = self._bad_objects.get(ref.entry.object_key)
            if until is not None:
                if until > now:
                    break
                del self._bad_objects[ref.entry.object_key]
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
        usable = self._usable_chunks(plan)
        if usable == 0:
            return 0, False
        hit = min(usable * self.ns.chunk_tokens, last_block)
        external = hit - num_computed_tokens
        if external <= 0 or external < self.cfg.min_hit_tokens:
            return 0, False
        plan.local, plan.external = num_computed_tokens, external
        plan.sync = self._in_step(plan, hit)
        return external, not plan.sync

    def _in_step(self, plan: _Plan, end: int) -> bool:
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
        pulled = sum(ref.entry.size for ref in self._pulled(plan, end))
        return 1000 * pulled / rate <= self.cfg.sync_budget_ms

    def _pulled(self, plan: _Plan, end: int) -> list[Any]:
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
        plan.block_ids = list(blocks.get_block_ids()[0])
        self._loads[request.request_id] = plan
        self.count(hit_tokens=plan.external)
        if plan.sync:
            self.count(loads_in_step=1)

    # -- metadata ---------------------------------------------------------------------------

    def _load_spec(self, req_id: str, plan: _Plan) -> LoadSpec:
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
                plan.block_ids[base + k] if first_block <= base + k < end_block else -1
                for k in range(per_chunk)
            ]
            if all(b < 0 or b == NULL_BLOCK for b in ids):
                continue  # wholly out of a sliding window: nothing of it is needed
            chunks.append(
                LoadChunk(
                    ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, ids
                )
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
        # every load vLLM allocated blocks for since the last step, whether the request is
        # new or resumed after a preemption (it waits for the load, not scheduled yet)
        for req_id, plan in self._loads.items():
            meta.loads.append(self._load_spec(req_id, plan))
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.pop(new.req_id, None)
            if plan is None:
                plan = self._unwaited_plan(new.req_id, new.num_computed_tokens)
            if plan is None or plan.skip:
                continue
            if self.cfg.write_policy == "off" or new.req_id in self._saving:
                continue
            stored = len(plan.match.chunks) if plan.match is not None else plan.stored
            saving = _Saving(
                plan.tenant,
                list(plan.fps),
                stored,
                list(new.block_ids[0]),
                self._requests.get(new.req_id) if self.cfg.save_decode else None,
            )
            computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._collect(new.req_id, saving, computed, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                # a resumed request asked again for its hit; that plan is spent now
                self._plans.pop(req_id, None)
            saving = self._saving.get(req_id)
            if saving is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # after a preemption vLLM hands over the request's whole block list again
                saving.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                saving.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._collect(req_id, saving, computed, meta)
        return meta

    def _unwaited_plan(self, rid: str, local: int) -> _Plan | None:
        """The plan of a request scheduled without waiting for its lookup: the index's
        answer if it is back, else its fingerprints with the chunks in vLLM's own cache
        taken as stored (this server computed and pushed them, or loaded them from kvcloud),
        so only the chunks beyond are saved. Never waits."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            return None
        if pending.future.done():
            try:
                plan = pending.future.result()
            except Exception as exc:  # a bug in the lookup thread: no saves for it
                log.warning("kvcloud lookup for %s failed: %s", rid, exc)
                return None
            return plan
        request = self._requests.get(rid)
        if request is None:
            return None
        plan = self._miss_plan(request)
        plan.stored = local // self.ns.chunk_tokens
        return plan

    def _collect(self, req_id: str, saving: _Saving, computed: int, meta: StepSpec) -> None:
        """Save the chunks this step completes: prompt chunks, and answer chunks too when the
        request's tokens are followed (``save_decode``)."""
        c, bs = self.ns.chunk_tokens, self.block_size
        per_chunk = c // bs
        if saving.request is not None:
            # only tokens vLLM has accepted: a step also computes KV for speculative draft
            # tokens it may reject, and with async scheduling the newest token is not known
            # yet; a chunk they end is saved at a later step, its blocks still the request's
            tokens = saving.request.all_token_ids
            computed = min(computed, len(tokens))
            if computed // c > len(saving.fps):
                saving.fps = self.client.fingerprints(
                    self.ns, list(tokens[: computed // c * c]), saving.tenant
                )
        ready = min(computed // c, len(saving.fps))
        chunks = []
        done = saving.next_chunk
        for j in range(saving.next_chunk, ready):
            ids = saving.block_ids[j * per_chunk : (j + 1) * per_chunk]
            if len(ids) < per_chunk:
                break
            done = j + 1
            if NULL_BLOCK in ids:
                continue  # partly out of a sliding window already: not whole, not saved
            parent = saving.fps[j - 1] if j else self.ns.digest
            chunks.append(SaveChunk(j, saving.fps[j], parent, ids))
        saving.next_chunk = done
        if chunks:
            meta.saves.append(SaveSpec(req_id, saving.tenant, chunks))
        if saving.request is None and saving.next_chunk >= len(saving.fps):
            self._saving.pop(req_id, None)  # every prompt chunk handed over
        else:
            self._saving[req_id] = saving

    # -- what the workers report ------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVCloudWorkerMeta):
            return
        now = self._clock()
        for key, seconds in meta.bad_objects.items():
            self._bad_objects[key] = now + seconds
        if meta.store_retry_in > 0:
            self._store_out_until = max(self._store_out_until, now + meta.store_retry_in)
        elif meta.store_ok:
            self._store_out_until = 0.0
        # bytes over summed seconds: restores that ran at the same time each count their own
        # time, so the rate is what one restore gets, not the store's total (the safe side
        # for a budget that one restore must fit)
        self._rate_in_step = _moved(self._rate_in_step, meta.in_step_bytes, meta.in_step_s)
        self._rate_beside = _moved(self._rate_beside, meta.beside_bytes, meta.beside_s)
        if len(self._bad_objects) > 4096:  # bounded: forget the ones that expired
            self._bad_objects = {k: t for k, t in self._bad_objects.items() if t > now}

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._plans.pop(rid, None)
        self._pending.pop(rid, None)
        self._loads.pop(rid, None)
        self._saving.pop(rid, None)
        self._requests.pop(rid, None)

    def take_stats(self) -> dict[str, int]:
        with self._stats_lock:
            out = dict(self.stats)
            self.stats.clear()
        if self._scheduler_ns:
            out["scheduler_us"] = self._scheduler_ns // 1000
            self._scheduler_ns = 0
        gauge = int(self.index_breaker.is_open)
        if gauge != self._index_gauge:
            out["index_breaker_open"] = self._index_gauge = gauge
        return out

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)


def _moved(rate: float | None, nbytes: int, seconds: float) -> float | None:
    """A moving average of bytes per second, a third of the way towards each new report
    (one slow restore on a busy step does not flip every later decision)."""
    if nbytes <= 0 or seconds <= 0:
        return rate
    now = nbytes / seconds
    return now if rate is None else rate + (now - rate) / 3
