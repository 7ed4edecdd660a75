"""Scheduler side, saves: which chunks each step's requests complete, named for the workers
to copy out in that step (``StepSpec.saves``).

Saves follow the request's KV as it is computed: each step names the chunks whose last
token's KV that step computes, prompt chunks during the prefill and (``save_decode``) the
chunks the answer fills while decoding, which in a chat are the next turn's prompt. A chunk
is named with its block ids in every KV cache group (several with vLLM's hybrid allocator),
and only while every group holds all of it: a sliding group's blocks behind the window are
vLLM's null block, or freed when the step was scheduled (``_freed``).

``SaveNaming`` is mixed into ``SchedulerSide`` (scheduler.py), whose state it uses.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .specs import NULL_BLOCK, SaveChunk, SaveSpec, StepSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...client import KVCloud
    from ...namespace import Namespace
    from .config import VLLMConnectorConfig
    from .lookups import Pending, Plan


def per_group(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids of a request, one list per KV cache group, as plain lists."""
    return [list(g) for g in block_ids]


def more_groups(ids: list[list[int]]) -> list[list[int]]:
    """A chunk spec's ``groups``: every group's ids where there are several, else none."""
    return ids if len(ids) > 1 else []


@dataclass
class Saving:
    """A request whose chunks are pushed as its steps complete them."""

    tenant: str
    fps: list[bytes]  # fingerprints of its full chunks known so far
    next_chunk: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    request: Any = None  # vLLM's Request: its tokens grow while it decodes (save_decode)
    # scheduled before its lookup was back, the chunks vLLM's own cache held (those below
    # ``unsure``) were not saved then; once the lookup answers, the ones the index lacks are
    # saved from the request's blocks (it holds them while it runs)
    unsure: int = 0
    lookup: cf.Future[Plan] | None = None
    rewind: bool = False  # resumed before the lookup answered: no backfill, rewind instead
    # restored in its first step: kept until the next step shows whether the restore held
    # (vLLM rewinds the request's computed tokens to a failed block, then recomputes)
    restored: bool = False


class SaveNaming:
    cfg: VLLMConnectorConfig
    ns: Namespace
    client: KVCloud
    block_size: int
    windows: list[int | None]
    sliding: bool
    count: Callable[..., None]
    _plans: dict[str, Plan]
    _pending: dict[str, Pending]
    _saving: dict[str, Saving]
    _requests: dict[str, Any]
    _unwaited_plan: Callable[[str, int], Plan | None]

    def _step_saves(self, scheduler_output: Any, meta: StepSpec) -> None:
        """The chunks this step's requests complete, into ``meta.saves``."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            plan = self._plans.pop(rid, None)
            saving = self._saving.get(rid)
            if saving is not None:
                # a request resumed after a preemption, which vLLM's V2 model runner sends
                # as a new request (resumed_req_ids stays empty): its blocks are all new,
                # the old ids belong to other requests now. Chunks already handed over stay
                # handed over; the rest are saved from the new blocks as they are computed.
                saving.block_ids = per_group(new.block_ids)
                # the chunks vLLM's cache held are not in these blocks until recomputed
                # (or loaded): no backfill from them; once the lookup answers, those the
                # index lacks are named as they are recomputed instead
                saving.unsure, saving.rewind = 0, saving.lookup is not None
                computed = new.num_computed_tokens + scheduled.get(rid, 0)
                self._collect(rid, saving, computed, meta, new.num_computed_tokens)
                continue
            lookup = None
            if plan is None:
                lookup = self._pending.get(rid)
                plan = self._unwaited_plan(rid, new.num_computed_tokens)
            if plan is None or plan.skip:
                continue
            if self.cfg.write_policy == "off":
                continue
            stored = len(plan.match.chunks) if plan.match is not None else plan.stored
            if plan.offered and new.num_computed_tokens < plan.local + plan.external:
                # its load failed part of the way (vLLM recomputes from the first failed
                # block): the chunks from there are saved again as they are recomputed
                stored = min(stored, new.num_computed_tokens // self.ns.chunk_tokens)
            saving = Saving(
                plan.tenant,
                list(plan.fps),
                stored,
                per_group(new.block_ids),
                self._requests.get(rid) if self.cfg.save_decode else None,
            )
            if lookup is not None and not lookup.future.done():
                saving.unsure, saving.lookup = stored, lookup.future
            saving.restored = plan.offered
            computed = new.num_computed_tokens + scheduled.get(rid, 0)
            self._collect(rid, saving, computed, meta, new.num_computed_tokens)
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
                saving.block_ids = per_group(new_ids) if new_ids is not None else []
                # (as for the V2 runner above)
                saving.unsure, saving.rewind = 0, saving.lookup is not None
            elif new_ids is not None:
                if not saving.block_ids:
                    saving.block_ids = [[] for _ in new_ids]
                for group, more in zip(saving.block_ids, new_ids, strict=True):
                    group.extend(more)
            before = cached.num_computed_tokens[i]
            resumed = req_id in cached.resumed_req_ids  # (its handed-over chunks were copied)
            if not resumed and before < saving.next_chunk * self.ns.chunk_tokens:
                # vLLM took back computed tokens: a restore in the step failed at that
                # block (its objects' entries are dropped), and it recomputes from there
                # into the same blocks: those chunks are saved again as they are recomputed
                saving.next_chunk = before // self.ns.chunk_tokens
                self.count(saves_rewound=1)
            saving.restored = False
            computed = before + scheduled.get(req_id, 0)
            self._collect(req_id, saving, computed, meta, before)

    def _collect(
        self, req_id: str, saving: Saving, computed: int, meta: StepSpec, before: int = 0
    ) -> None:
        """Save the chunks this step completes: prompt chunks, and answer chunks too when the
        request's tokens are followed (``save_decode``). ``before``: the request's computed
        tokens when this step was scheduled (where a sliding window had moved to)."""
        c = self.ns.chunk_tokens
        chunks = self._backfill(saving, computed) if saving.lookup is not None else []
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
        done = saving.next_chunk
        for j in range(saving.next_chunk, ready):
            ids = self._chunk_ids(saving.block_ids, j)
            if ids is None:
                break
            done = j + 1
            if any(NULL_BLOCK in g for g in ids) or self._freed(j, before):
                # partly out of a sliding window already: not whole in every group, so not
                # saved (a chunk is stored only with every group's part of it)
                self.count(saves_skipped=1)
                continue
            parent = saving.fps[j - 1] if j else self.ns.digest
            chunks.append(SaveChunk(j, saving.fps[j], parent, ids[0], more_groups(ids)))
        saving.next_chunk = done
        if chunks:
            meta.saves.append(SaveSpec(req_id, saving.tenant, chunks))
        if (
            saving.request is None
            and saving.next_chunk >= len(saving.fps)
            and saving.lookup is None
            and not saving.restored
        ):
            self._saving.pop(req_id, None)  # every prompt chunk handed over
        else:
            self._saving[req_id] = saving

    def _backfill(self, saving: Saving, computed: int) -> list[SaveChunk]:
        """Once the lookup of a request scheduled without it is back: the chunks vLLM's own
        cache held that the index lacks (computed here by a request whose saves were lost,
        or still in flight), saved now from this request's blocks."""
        future = saving.lookup
        if future is None or not future.done():
            return []
        saving.lookup = None
        try:
            plan = future.result()
        except Exception:  # a bug in the lookup thread: nothing known, nothing saved again
            return []
        if plan.skip or plan.failed:
            return []
        known = len(plan.match.chunks) if plan.match is not None else 0
        if saving.rewind:  # resumed meanwhile: named as they are recomputed
            saving.next_chunk = min(saving.next_chunk, known)
            return []
        out = []
        # only chunks whose KV is in the request's blocks by this step (the window of a
        # sliding-window model may have moved past older ones: see self.sliding)
        if self.sliding:
            return []
        end = min(saving.unsure, len(saving.fps), computed // self.ns.chunk_tokens)
        for j in range(known, end):
            ids = self._chunk_ids(saving.block_ids, j)
            if ids is None or any(NULL_BLOCK in g for g in ids):
                continue
            parent = saving.fps[j - 1] if j else self.ns.digest
            out.append(SaveChunk(j, saving.fps[j], parent, ids[0], more_groups(ids)))
        if out:
            self.count(chunks_backfilled=len(out))
        return out

    def _chunk_ids(self, block_ids: list[list[int]], j: int) -> list[list[int]] | None:
        """Chunk ``j``'s block ids in each KV cache group; None until every group has them."""
        per_chunk = self.ns.chunk_tokens // self.block_size
        ids = [g[j * per_chunk : (j + 1) * per_chunk] for g in block_ids]
        if not ids or any(len(g) < per_chunk for g in ids):
            return None
        return ids

    def _freed(self, j: int, before: int) -> bool:
        """Whether vLLM may have freed (and handed to another request) a block of chunk
        ``j`` in a sliding group when it scheduled this step: it frees the blocks wholly
        behind the window of the tokens computed by then (``get_num_skipped_tokens``:
        ``computed - window + 1``, on tokens already processed, which ``before`` bounds
        from above). Their ids still stand in this side's list; vLLM's own list holds its
        null block there."""
        first = j * self.ns.chunk_tokens // self.block_size
        return any(
            w is not None and first < max(0, before - w + 1) // self.block_size
            for w in self.windows
        )
