"""Scheduler side: decide what each request loads from kvcloud and which chunks it pushes.

Cheap and tensor-free. One kvcloud index lookup per request (cached, because vLLM may ask
again), made with the fingerprints of the prompt's full chunks; the hit offered to vLLM is
the run of stored chunks beyond vLLM's own prefix-cache hit, cut at the last vLLM block
before the prompt's final token (vLLM must compute at least one token to sample from).
Loads are synchronous: the blocks are filled during the forward pass that consumes them,
layer by layer, which gives the best TTFT on an engine that is not already busy (an
asynchronous load costs at least one extra engine step before the request runs) — and a
load can never stall longer than ``load_timeout``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...client import KVCloud, Match
from ...namespace import Namespace
from .config import VLLMConnectorConfig
from .keys import request_tenant
from .metadata import KVCloudConnectorMetadata
from .specs import LoadChunk, LoadSpec, SaveChunk, SaveSpec

log = logging.getLogger("vllm.kvcloud")


@dataclass
class _Plan:
    """A request's lookup: its prompt fingerprints and the kvcloud hit."""

    tenant: str
    fps: list[bytes]  # every full chunk of the prompt
    match: Match
    local: int = 0  # vLLM's own hit when the load was offered
    external: int = 0  # tokens offered beyond it


@dataclass
class _Saving:
    """A request whose prompt chunks are pushed as its prefill completes them."""

    tenant: str
    fps: list[bytes]
    next_chunk: int
    block_ids: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(
        self, cfg: VLLMConnectorConfig, ns: Namespace, client: KVCloud, block_size: int
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        self.client = client
        self.block_size = block_size
        self._plans: dict[str, _Plan] = {}
        self._loads: dict[str, _Plan] = {}  # offered and allocated, not yet in metadata
        self._saving: dict[str, _Saving] = {}
        self.stats: Counter[str] = Counter()

    # -- lookups ----------------------------------------------------------------------------

    def _plan(self, request: Any) -> _Plan:
        plan = self._plans.get(request.request_id)
        if plan is not None:
            return plan
        tokens = list(request.prompt_token_ids or [])
        tenant = request_tenant(self.cfg.tenant, getattr(request, "cache_salt", None))
        fps = self.client.fingerprints(self.ns, tokens, tenant) if tokens else []
        t0 = time.perf_counter()
        errors_before = self.client.stats().get("index_errors", 0)
        # every full chunk: the hit decides what is loaded and what is already stored
        match = self.client.lookup_fingerprints(self.ns, fps, tenant=tenant)
        self.stats["lookups"] += 1
        if self.client.stats().get("index_errors", 0) > errors_before:
            self.stats["lookup_errors"] += 1
        log.debug(
            "lookup %s: %d of %d chunks in kvcloud (%.1f ms)",
            request.request_id,
            len(match.chunks),
            len(fps),
            (time.perf_counter() - t0) * 1000,
        )
        plan = self._plans[request.request_id] = _Plan(tenant, fps, match)
        return plan

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not request.prompt_token_ids:
            return 0
        plan = self._plan(request)
        # vLLM must compute at least the prompt's last token to sample from it. The hit ends
        # on a vLLM block boundary: of the last stored chunk it reaches, only the blocks
        # before that token are loaded (the object is pulled and verified whole), so a
        # prompt that is an exact multiple of the chunk recomputes one block, not one chunk.
        last_block = (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        hit = min(plan.match.tokens, last_block)
        external = hit - num_computed_tokens
        if external <= 0 or external < self.cfg.min_hit_tokens:
            return 0
        plan.local, plan.external = num_computed_tokens, external
        return external

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or num_external_tokens <= 0:
            return
        if num_external_tokens != plan.external:
            # vLLM may trim an offer from its end (to a block boundary): load exactly the
            # blocks it now expects us to fill, and none that it will compute itself
            plan.external = min(plan.external, num_external_tokens)
        self._loads[request.request_id] = plan
        self.stats["hit_tokens"] += num_external_tokens

    # -- metadata ---------------------------------------------------------------------------

    def _load_spec(self, req_id: str, plan: _Plan, block_ids: list[int]) -> LoadSpec:
        c, bs = self.ns.chunk_tokens, self.block_size
        per_chunk = c // bs
        first_block = plan.local // bs
        end = plan.local + plan.external
        end_block = end // bs
        chunks = []
        for ref in plan.match.chunks:
            if (ref.position + 1) * c <= plan.local or ref.position * c >= end:
                continue
            base = ref.position * per_chunk
            ids = [
                block_ids[base + k] if first_block <= base + k < end_block else -1
                for k in range(per_chunk)
            ]
            chunks.append(
                LoadChunk(
                    ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, ids
                )
            )
        return LoadSpec(req_id, plan.tenant, chunks)

    def build_connector_meta(self, scheduler_output: Any) -> KVCloudConnectorMetadata:
        meta = KVCloudConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            plan = self._loads.pop(new.req_id, None)
            if plan is not None:
                meta.loads.append(self._load_spec(new.req_id, plan, block_ids))
            plan = plan or self._plans.get(new.req_id)
            self._plans.pop(new.req_id, None)
            if plan is None or self.cfg.write_policy == "off":
                continue
            saving = _Saving(plan.tenant, plan.fps, len(plan.match.chunks), block_ids)
            computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._collect(new.req_id, saving, computed, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            saving = self._saving.get(req_id)
            if saving is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                saving.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                saving.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._collect(req_id, saving, computed, meta)
        return meta

    def _collect(
        self, req_id: str, saving: _Saving, computed: int, meta: KVCloudConnectorMetadata
    ) -> None:
        """Save the prompt chunks this step completes."""
        c, bs = self.ns.chunk_tokens, self.block_size
        per_chunk = c // bs
        ready = min(computed // c, len(saving.fps))
        chunks = []
        for j in range(saving.next_chunk, ready):
            ids = saving.block_ids[j * per_chunk : (j + 1) * per_chunk]
            if len(ids) < per_chunk:
                break
            parent = saving.fps[j - 1] if j else self.ns.digest
            chunks.append(SaveChunk(j, saving.fps[j], parent, ids))
        saving.next_chunk += len(chunks)
        if chunks:
            meta.saves.append(SaveSpec(req_id, saving.tenant, chunks))
        if saving.next_chunk >= len(saving.fps):
            self._saving.pop(req_id, None)
        else:
            self._saving[req_id] = saving

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._plans.pop(rid, None)
        self._loads.pop(rid, None)
        self._saving.pop(rid, None)

    def take_stats(self) -> dict[str, int]:
        out = dict(self.stats)
        self.stats.clear()
        return out
