"""The scheduler side's index lookups: one per new request, on lookup threads, waited for
within one ``lookup_wait_ms`` per scheduler step (a slow index never stalls the engine).

A request's lookup starts when vLLM first sees it (``on_new_request``). When vLLM asks for its
hit the answer is usually back; if not, the ask answers ``None`` ("ask again next step") and
vLLM schedules every other request meanwhile. A lookup out longer than ``lookup_timeout`` is
a miss for that request alone, and counts as a failure of the index (its circuit breaker).
The tenant scope (keys.request_scope: a LoRA adapter's digest reads its files) is computed on
the lookup thread, never on vLLM's.

:class:`Lookups` is mixed into :class:`~.scheduler.SchedulerSide`, which owns the state.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...client import KVCloud, Match
from .keys import SkipRequest, request_scope

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...breaker import CircuitBreaker
    from ...namespace import Namespace
    from .config import VLLMConnectorConfig

log = logging.getLogger("vllm.kvcloud")


@dataclass
class Plan:
    """A request's lookup: its prompt fingerprints and the kvcloud hit."""

    tenant: str
    fps: list[bytes]  # every full chunk of the prompt
    match: Match | None  # None: no hit (miss, failure, skipped)
    stored: int = 0  # leading chunks known stored without the index (match is None)
    skip: bool = False  # a request kvcloud cannot key: neither loaded nor saved
    failed: bool = False  # the index did not answer: what is stored is unknown
    local: int = 0  # vLLM's own hit when the load was offered
    external: int = 0  # tokens offered beyond it
    sync: bool = False  # the load runs in the step that schedules the request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    # vLLM allocated blocks for this plan's load: asked again before the request was
    # scheduled, the load failed from its first block (vLLM sets the request back to no
    # computed tokens and asks again); the same offer would fail the same way, forever
    offered: bool = False


@dataclass
class Pending:
    """A lookup in flight."""

    future: cf.Future[Plan]
    started: float
    asked: bool = False  # vLLM has asked for this request's hit before
    # when its thread began the lookup (empty while it waits behind others): only the time
    # in the index counts against the index (its breaker); queueing here is not an outage
    began: list[float] = field(default_factory=list)


class Lookups:
    """The lookup machinery of the scheduler side (state set by SchedulerSide)."""

    cfg: VLLMConnectorConfig
    ns: Namespace
    client: KVCloud
    index_breaker: CircuitBreaker
    count: Callable[..., None]
    observe: Callable[[str, float], None]
    _clock: Callable[[], float]
    _plans: dict[str, Plan]
    _pending: dict[str, Pending]
    _requests: dict[str, Any]
    _lookups: cf.ThreadPoolExecutor
    _wait_left: float
    _scheduler_ns: int

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

    def _start(self, request: Any) -> Plan | None:
        """Start the request's lookup; a plan at once when the index is not to be touched."""
        rid = request.request_id
        if not self.index_breaker.allow():
            self.count(lookups_skipped=1)
            # no hit, but the prompt is still saved (a few µs of hashing): the uploader has
            # a client of its own, and the index may be back before the push goes out
            plan = self._plans[rid] = self._miss_plan(request)
            return plan
        tokens = list(request.prompt_token_ids)
        began: list[float] = []
        future = self._lookups.submit(
            self._lookup, rid, request, tokens, time.perf_counter_ns(), began
        )
        self._pending[rid] = Pending(future, self._clock(), began=began)
        return None

    def _scope(self, request: Any) -> str | None:
        """The request's tenant scope, None (counted, logged) for a request kvcloud cannot
        key. Digesting a LoRA adapter reads its files: done on a lookup thread as a rule."""
        try:
            return request_scope(self.cfg.tenant, request)
        except SkipRequest as exc:
            self.count(requests_skipped=1)
            log.info("kvcloud: request %s runs without kvcloud: %s", request.request_id, exc)
            return None

    def _lookup(
        self, rid: str, request: Any, tokens: list[int], submitted_ns: int, began: list[float]
    ) -> Plan:
        """On a lookup thread: the tenant scope, fingerprints, then one index round trip."""
        began.append(self._clock())
        try:
            tenant = self._scope(request)
            if tenant is None:
                return Plan("", [], None, skip=True)
            return self._lookup_plan(rid, tenant, tokens)
        finally:
            # from the request's arrival: a lookup queued behind others, or starved of the
            # CPU or the GIL by the forward pass, is what defers a request a step
            took_ns = time.perf_counter_ns() - submitted_ns
            self.count(lookup_us=took_ns // 1000)
            self.observe("lookup_seconds", took_ns / 1e9)

    def _lookup_plan(self, rid: str, tenant: str, tokens: list[int]) -> Plan:
        t0 = time.perf_counter()
        fps = self.client.fingerprints(self.ns, tokens, tenant)
        try:
            # every full chunk: the hit decides what is loaded and what is already stored
            match = self.client.lookup_fingerprints(self.ns, fps, tenant=tenant, strict=True)
        except Exception as exc:  # any failure of the index is a miss, and counts
            self.count(lookup_errors=1)
            self.index_breaker.failure(type(exc).__name__)
            log.debug("lookup %s failed: %s", rid, exc)
            return Plan(tenant, fps, None, failed=True)
        self.index_breaker.success()
        log.debug(
            "lookup %s: %d of %d chunks in kvcloud (%.1f ms)",
            rid,
            len(match.chunks),
            len(fps),
            (time.perf_counter() - t0) * 1000,
        )
        return Plan(tenant, fps, match)

    def _resolve(self, request: Any) -> Plan | None:
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
        # only the first ask waits (a healthy lookup answers well within it), and all the
        # asks of one scheduler step share one lookup_wait_ms; later asks just look, so a
        # lookup stuck in a sick index costs each engine step nothing
        wait = 0.0 if pending.asked else self._wait_left
        pending.asked = True
        t0 = time.monotonic()
        try:
            plan = pending.future.result(timeout=wait)
        except cf.TimeoutError:
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - t0))
            now = self._clock()
            waited = now - pending.started
            if waited < self.cfg.lookup_timeout and not self.index_breaker.is_open:
                self.count(lookup_deferrals=1)
                return None
            # too long, or the index went down meanwhile: this request runs as a miss
            self.count(lookup_timeouts=1)
            in_index = now - pending.began[0] if pending.began else 0.0
            if in_index >= self.cfg.lookup_timeout:
                self.index_breaker.failure("lookup timed out", timeout=True)
            elif waited >= self.cfg.lookup_timeout:
                # queued behind a burst of other lookups on this scheduler: not the
                # index's fault; the lookup is dropped if it has not started yet
                self.count(lookup_queue_timeouts=1)
                pending.future.cancel()
            plan = self._miss_plan(request)
        except Exception as exc:  # a bug in the lookup thread: a miss, never a failed request
            log.warning("kvcloud lookup for %s failed: %s", rid, exc)
            plan = self._miss_plan(request)
        else:
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - t0))
        self._pending.pop(rid, None)
        self.count(lookups=1)
        self._plans[rid] = plan
        return plan

    def _miss_plan(self, request: Any) -> Plan:
        """A request served as a miss without the index's answer: nothing is loaded, but
        its chunks (prompt, and answer as the decode fills them) are still saved; the
        uploader skips those already indexed."""
        tenant = self._scope(request)
        if tenant is None:
            return Plan("", [], None, skip=True)
        fps = self.client.fingerprints(self.ns, list(request.prompt_token_ids), tenant)
        return Plan(tenant, fps, None)

    def _unwaited_plan(self, rid: str, local: int) -> Plan | None:
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
            if plan.failed:  # the index is down: what vLLM holds was stored, as a rule
                plan.stored = local // self.ns.chunk_tokens
            return plan
        request = self._requests.get(rid)
        if request is None:
            return None
        plan = self._miss_plan(request)
        plan.stored = local // self.ns.chunk_tokens
        return plan
