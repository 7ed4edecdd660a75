"""Restores: pull kvcloud objects into staging and write them, verified, into vLLM's blocks.

A restore runs beside the forward pass unless the scheduler side put it in the step (its spec
says ``sync``: ``load_mode=sync``, or ``auto`` when measured short), so a slow store makes no
forward pass wait beyond that. ``start_load_kv`` hands each restore beside the pass to a load
thread, which pulls every matched object in parallel (on the store's threads), and each chunk of
a restore in the step to a thread of its own (never queued behind a restore beside the pass, nor
behind its pulls on the store's threads). Each object is streamed straight into a slot of the
staging ring (staging.py: bounded, allocated once) in kvcloud's layout and hashed as it lands,
and each layer of each chunk is
written into the request's blocks as soon as that layer is verified — blocks no forward pass
reads until vLLM is told the load is over (or, in the step, until that layer is written). After
each step ``get_finished`` reports the restores that are over: done, or past their deadline
(then abandoned: its pulls stop at the next layer that arrives, and never touch vLLM's blocks
again). The deadline is ``load_timeout`` from when the restore's pull started; a restore still
queued on this worker ``load_timeout`` after it was submitted is given up too, but the store
never had it: that is not counted against the store (its breaker, the objects remembered as
bad). A chunk that is missing, corrupt, late or unreachable — and every chunk after it — is
reported through ``get_block_ids_with_load_errors`` in that same pass, before the request is
ever scheduled, so vLLM recomputes exactly those tokens. For a restore in the step,
``start_load_kv`` returns at once and ``wait_for_layer_load(layer)`` waits until that layer of
every such restore is written (at most until its deadline: ``load_timeout``, or four
``sync_budget_ms`` for one ``auto`` put there), so layer 0 computes while later layers are still
arriving; a restore past its deadline is abandoned between two layer writes, and its failed
blocks are reported after that same step (vLLM then discards the step's output for the request
and recomputes). Where a full CUDA graph may replay the step, no per-layer hook runs:
``start_load_kv`` then returns only once every restore in the step is written or given up
(``full_graphs``). No byte reaches vLLM's cache before it is verified: each layer of a chunk is
checked against its digest in the header before it is written (invariant 3, verify on
read); the blocks of a chunk whose later layer fails are reported for recompute with it.
Nothing here raises into vLLM.

A circuit breaker on the store, and a memory of objects whose pull failed or timed out,
keep a sick store from costing every request a timeout; both are reported to the scheduler
side (``build_connector_worker_meta``) so it stops offering such loads at all.

The machinery lives in :class:`Restores`, which :class:`~.worker.WorkerSide` mixes in: its
entry points (``start_load_kv``, ``wait_for_layer_load``, ``get_finished``,
``build_worker_meta``) start restores and report them, this module runs them.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...client import ChunkRef, Match, PullResult
from ...indexes.base import IndexEntry
from .._torch import to_numpy
from .device import PASSED, Fence
from .expiring import Expiring
from .layout import Blocks, block_index
from .specs import LoadSpec, filled, group_ids, restored_tokens, spans
from .staging import StagingRing

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...client import KVCloud
    from ...namespace import Namespace
    from .config import VLLMConnectorConfig
    from .device import Streams
    from .layout import BlockLayout
    from .shard import Shard

log = logging.getLogger("vllm.kvcloud")

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # vLLM allocates fp8 caches as uint8 (its kernels read the bytes as fp8): kvcloud moves
    # the bytes as they are, half the traffic of bf16
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
}
# the fp8 format each fp8 namespace dtype's bytes are in
FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


class _GivenUp(Exception):
    """Raised from a pull's layer callback once its restore was given up: the pull stops
    at that layer instead of reading the rest of its objects from the store."""


@dataclass
class Load:
    spec: LoadSpec
    # when it is given up (clock): its submission plus ``timeout`` while it is queued here,
    # then its pull's start plus ``timeout`` (the store is answerable from then on only)
    deadline: float
    # chunks verified and written into vLLM's blocks, once every pull of the restore ended
    future: cf.Future[int] | None = None
    # held while a layer of a chunk is written into vLLM's blocks, and to abandon the restore
    lock: threading.Lock = field(default_factory=threading.Lock)
    layer_in: threading.Condition = field(init=False)  # on ``lock``: a layer written, or over
    written: list[int] = field(default_factory=list)  # per layer: chunks written into vLLM's
    over: bool = False  # the pull returned: nothing more will be written
    limit: int = 0  # chunks to pull: those before the first object remembered as bad
    abandoned: bool = False  # reported as failed: the thread must not touch vLLM's blocks
    ended: float = 0.0  # when the thread was done with it (monotonic), 0 while running
    pulled: int = 0  # bytes pulled
    after: Fence = PASSED  # the engine's work queued before the blocks were handed over
    timeout: float = 0.0  # seconds its pull may run
    started: float | None = None  # when its pull started (clock); None while queued here
    began: float = 0.0  # the same, monotonic (for the counters)
    parts: int = 0  # pulls not yet ended: one beside the pass, one per chunk in the step
    results: list[tuple[range, PullResult]] = field(default_factory=list)  # per pull
    errors: list[BaseException] = field(default_factory=list)  # pulls that raised
    write_s: float = 0.0  # seconds writing into vLLM's blocks (writes are serialized)
    # of those, the CPU seconds of the writing threads: far less than write_s when the
    # writes wait for a core (vLLM's own processes poll on every core of a CPU server)
    write_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        self.layer_in = threading.Condition(self.lock)


def _runs(ids: list[int], device: Any) -> list[tuple[int, int, Blocks]]:
    """The spans of one group's block ids to write, each with its device index."""
    return [(a, b, block_index(ids[a:b], device)) for a, b in spans(ids)]


@dataclass
class _Moved:
    bytes: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, float]:
        out = (self.bytes, self.seconds)
        self.bytes, self.seconds = 0, 0.0
        return out


class LoadPools:
    """The load threads: restores beside the pass on ``load_threads`` of them, the chunks of
    restores in the step on threads of their own, so the forward pass never waits behind a
    restore it does not read (one queue let a busy store stall every in-step restore, and
    time spent queued here read as a store outage)."""

    def __init__(self, beside: int, in_step: int) -> None:
        self.beside = cf.ThreadPoolExecutor(beside, thread_name_prefix="kvcloud-load")
        self.in_step = cf.ThreadPoolExecutor(in_step, thread_name_prefix="kvcloud-load-step")

    def submit(self, in_step: bool, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        return (self.in_step if in_step else self.beside).submit(fn, *args)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for pool in (self.in_step, self.beside):
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class Restores:
    """The restore machinery of the worker side, mixed into WorkerSide: loads in flight,
    staging memory, the store's circuit breaker and the objects remembered as bad."""

    # set by WorkerSide (__init__, register_kv_caches)
    cfg: VLLMConnectorConfig
    ns: Namespace
    client: KVCloud
    shard: Shard
    num_layers: int
    block_size: int
    streams: Streams
    caches: dict[str, torch.Tensor]
    layer_index: dict[str, int]
    group_of: dict[str, int]  # each layer's KV cache group
    groups: int  # KV cache groups
    whole_failures: bool  # a failed restore is reported as its request (specs.whole_failures)
    layouts: dict[str, BlockLayout]
    _chunk_shape: tuple[int, ...]
    count: Callable[..., None]
    observe: Callable[[str, float], None]

    def __init__(self, cfg: VLLMConnectorConfig, clock: Any) -> None:
        self._clock = clock
        # a restore in the step pulls each chunk on a thread of its own (threads start only
        # when needed): as many at once as the store reads in parallel for one beside it
        store_threads = int(getattr(getattr(self.client, "store", None), "max_workers", 1))
        self._pool = LoadPools(cfg.load_threads, max(cfg.load_threads, store_threads))
        # full CUDA graphs may replay a step, running no per-layer hook: restores in the step
        # are then whole before start_load_kv returns (WorkerSide sets it from vLLM's config)
        self.full_graphs = False
        self._loads: dict[str, Load] = {}  # by request id, until reported finished
        # restores the forward pass of this step reads (load_mode=sync, or auto when short):
        # it waits for each layer (wait_for_layer_load); they are settled after the pass
        self._stepping: list[Load] = []
        self._ring: StagingRing | None = None  # host staging, made on first use
        self._ring_lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # the same, by request (whole_failures)
        self.store_breaker = cfg.breaker("store", clock, self._breaker_changed)
        self._bad_objects = Expiring()  # object keys, until (clock)
        self._new_bad: dict[str, float] = {}  # not yet reported to the scheduler
        self._meta_lock = threading.Lock()
        # restores ended since the last report: bytes and seconds, in the step and beside it
        self._in_step = _Moved()
        self._beside = _Moved()
        # restores given up at their timeout: the bytes they got over the time they had (the
        # cost guard's measure of a store too slow to finish one)
        self._given_up = _Moved()

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            self.count(store_breaker_opened=1)

    def restores_in_flight(self) -> int:
        """Restores submitted and not yet ended (queued here or pulling): the gauge."""
        return sum(1 for load in list(self._loads.values()) if not load.ended)

    def _in_step_load(self, spec: LoadSpec) -> bool:
        # the scheduler side decides (``spec.sync``); the worker's own setting only counts
        # for specs built without it (tests, or a scheduler side older than the worker)
        # (never where failures are whole: vLLM can only hear such a restore failed as a
        # whole request waiting for it, which one in the step is not)
        return spec.sync or (self.cfg.load_mode == "sync" and not self.whole_failures)

    def _timeout(self, spec: LoadSpec) -> float:
        """How long a restore may run: ``load_timeout``, and for one that ``load_mode=auto``
        put in the step, four budgets at most (the whole batch waits for it)."""
        if self.cfg.load_mode == "auto" and spec.sync:
            return min(self.cfg.load_timeout, 4 * self.cfg.sync_budget_ms / 1000)
        return self.cfg.load_timeout

    def _settle_stepping(self) -> None:
        """After the forward pass, the restores in the step (``load_mode=sync``, or ``auto``
        when measured short): each is over (the pass waited for every layer), or waited for
        until its deadline, then abandoned; what failed is reported after this step. They
        are never reported as asynchronous loads."""
        loads, self._stepping = self._stepping, []
        for load in loads:
            try:
                self._await(load)
                self._settle(load, self._outcome(load, self._clock(), force=True) or 0)
            except Exception as exc:
                # its blocks reported failed rather than left as if loaded: vLLM already
                # counts them computed, and would read and cache whatever they hold
                self._fail_all(load, exc)

    def _fail_all(self, load: Load, exc: Exception) -> None:
        """A restore whose settling raised: abandoned (its thread writes nothing from here
        on) and every one of its blocks reported failed, so vLLM recomputes them."""
        log.warning("kvcloud: settling the restore of %s: %s", load.spec.req_id, exc)
        self.count(connector_errors=1)
        with load.lock:
            load.abandoned = True
        self._fail_blocks(load, filled(load.spec))

    def _layer_written(self, load: Load, layer: int) -> bool:
        """Until the restore has written ``layer`` of each chunk, or is over, or given up
        (True); False once its deadline passed first."""
        with load.lock:
            while not (load.over or load.abandoned or load.written[layer] >= load.limit):
                # read again after each wake: the deadline moves when the pull starts
                left = load.deadline - self._clock()
                if left <= 0:
                    return False
                load.layer_in.wait(left)
            return True

    def _await(self, load: Load) -> None:
        """Until the restore is over or past its deadline (which moves once its pull starts:
        the wait is cut in pieces and the deadline read again after each)."""
        future = load.future
        if future is None:
            return
        while not future.done():
            left = load.deadline - self._clock()
            if left <= 0:
                return
            cf.wait([future], timeout=left)

    def _complete_stepping(self) -> None:
        """Before a pass a full CUDA graph may replay (``full_graphs``): no
        ``wait_for_layer_load`` will run, so every restore in the step is waited for here
        until it is over, or given up at its deadline (then nothing more is written under
        the pass's reads; it is reported failed after the step). Then the engine's stream
        waits for the block writes queued on the load stream."""
        for load in self._stepping:
            future = load.future
            while future is not None and not future.done():
                self._await(load)
                # past its deadline: given up; not if its pull just started (a later
                # deadline: wait again) or is over (every write done)
                if future.done() or self._expire(load) or load.over:
                    break
        self.streams.after_loads()

    def _expire(self, load: Load, force: bool = False) -> bool:
        """Give up a restore past its deadline (or, with ``force``, now), between two layer
        writes: none is written after this (vLLM may give the blocks to another request),
        whatever was is recomputed. Blamed on the store (its breaker told, the first object
        remembered as bad, ``load_timeouts``) only if the store had it the whole timeout;
        one given up while queued on this worker (``load_queue_timeouts``) never reached
        the store, or too late to blame it. Returns whether the restore is given up (not
        when its pull is over: its writes are done and its outcome a moment away)."""
        now = self._clock()
        with load.lock:
            if load.abandoned:
                return True
            if load.over or (now < load.deadline and not force):
                return False
            load.abandoned = True
            blame = load.started is not None and now >= load.started + load.timeout
            # the bytes it got by now: the layers verified and written, each about a
            # layer's share of its object (pulls report their bytes only when they end)
            sizes = [ch.size for ch in load.spec.chunks[: load.limit]]
            got = sum(load.written) * sum(sizes) / max(1, len(sizes) * self.num_layers)
        if not blame:
            log.warning(
                "kvcloud restore of %s given up: it waited on this worker's load threads "
                "for most of its %.2fs, not on the store: recomputing (too few load_threads?)",
                load.spec.req_id,
                load.timeout,
            )
            self.count(load_queue_timeouts=1)
            return True
        log.warning(
            "kvcloud restore of %s ran past its timeout (%.2fs): recomputing",
            load.spec.req_id,
            load.timeout,
        )
        self.count(load_timeouts=1)
        assert load.started is not None
        with self._meta_lock:  # what the store delivered in the time it had: its rate
            self._given_up.bytes += int(got)
            self._given_up.seconds += now - load.started
        self._remember_bad(load.spec.chunks[0].object_key)
        self.store_breaker.failure("restore timed out", timeout=True)
        return True

    def _is_bad(self, key: str) -> bool:
        with self._meta_lock:
            return self._bad_objects.holds(key, self._clock())

    def _remember_bad(self, key: str) -> None:
        now = self._clock()
        until = now + self.cfg.failure_memory
        with self._meta_lock:
            self._bad_objects.add(key, until, now)
            self._new_bad[key] = self.cfg.failure_memory

    def _staging(self) -> StagingRing:
        """The ring every restore's pulls stream through (staging.py): ``staging_mib``."""
        with self._ring_lock:
            if self._ring is None:
                self._ring = StagingRing(
                    self.streams,
                    self._chunk_shape,
                    TORCH_DTYPES[self.ns.dtype],
                    self.cfg.staging_mib << 20,
                )
            return self._ring

    def _submit(self, load: Load) -> None:
        """Start a restore's pulls. Beside the pass, one on a load thread (the store's
        threads pull its chunks in parallel). In the step, one per chunk on the in-step
        threads, each reading its object on that thread: not on the store's threads, where
        it would queue behind the pulls of restores beside the pass."""
        in_step = self._in_step_load(load.spec)
        n = load.limit
        parts = [range(i, i + 1) for i in range(n)] if in_step else [range(n)]
        load.future = cf.Future()
        load.parts = len(parts)
        for part in parts:
            self._pool.submit(in_step, self._restore, load, part)

    def _restore(self, load: Load, part: range) -> None:
        """On a load thread: pull the chunks ``part`` of a restore, each layer written into
        vLLM's blocks once verified, unless the restore was given up meanwhile (then, still
        queued, it never reaches the store). The last pull to end completes the restore."""
        with load.lock:
            go = not load.abandoned
            if go and load.started is None:
                # the store has it from now on: its deadline counts from here
                load.started = self._clock()
                load.deadline = load.started + load.timeout
                load.began = time.monotonic()
        error: BaseException | None = None
        if go:
            try:
                self._pull_part(load, part)
            except _GivenUp:  # reported failed already; the rest of its objects not read
                self.count(pulls_stopped=1)
            except Exception as exc:  # reported failed (recomputed), never raised into vLLM
                error = exc
        with load.lock:
            if error is not None:
                load.errors.append(error)
            load.parts -= 1
            last = load.parts == 0
        if last:
            self._end(load)

    def _pull_part(self, load: Load, part: range) -> None:
        """Pull chunks ``part`` through the staging ring, as many at once as it has slots,
        each group's result added to the restore's as it ends; a group with a chunk that
        failed ends the part (the chunks after it are recomputed anyway)."""
        ring = self._staging()
        for first in range(part.start, part.stop, ring.slots):
            group = range(first, min(first + ring.slots, part.stop))
            slots = ring.acquire(
                len(group), lambda: load.abandoned or self._clock() >= load.deadline
            )
            if slots is None:
                raise _GivenUp  # its deadline passed waiting for room: recomputed
            try:
                result = self._pull_group(load, group, [ring.view(k) for k in slots])
            finally:  # the pulls into them ended: every write from them is done
                ring.release(slots)
            with load.lock:
                load.results.append((group, result))
            if result.chunks < len(group):
                return

    def _pull_group(self, load: Load, group: range, staging: list[torch.Tensor]) -> PullResult:
        """Pull chunks ``group`` into ``staging`` (one slot each); each layer of each chunk is
        written into its blocks as soon as it is verified (object format 3 verifies layer by
        layer), so the forward pass of a restore in the step can run layer l while later
        layers are still in flight."""
        spec = load.spec
        c = self.ns.chunk_tokens
        chunks = spec.chunks[group.start : group.stop]
        refs = tuple(
            ChunkRef(ch.position, ch.fp, ch.parent, IndexEntry(ch.object_key, c, ch.size, 0.0))
            for ch in chunks
        )
        m = Match(self.ns, spec.tenant, refs, refs[-1].position + 1)
        device = self.streams.device
        # per chunk, per KV cache group: the runs of blocks to write
        targets = [[_runs(ids, device) for ids in group_ids(ch)] for ch in chunks]
        group_of = self.group_of
        names = {layer: name for name, layer in self.layer_index.items()}

        def write(j: int, layer: int) -> None:
            with load.lock:  # writes are serialized, so their seconds add up to wall time
                if load.abandoned:
                    # vLLM may have given the blocks to another request; and nothing more
                    # of this restore is wanted: stop pulling (a sick store is spared it)
                    raise _GivenUp
                t0, cpu0 = time.monotonic(), time.thread_time()
                with self.streams.loading(load.after):
                    name = names[layer]
                    self._write_layer(name, staging[j][layer], targets[j][group_of.get(name, 0)])
                load.write_s += time.monotonic() - t0
                load.write_cpu_s += time.thread_time() - cpu0
                load.written[layer] += 1
                load.layer_in.notify_all()

        return self.client.pull_into(
            m,
            [to_numpy(buf) for buf in staging],
            heads=self.shard.heads,
            layers=self.shard.layers,
            on_layer=write,
        )

    def _end(self, load: Load) -> None:
        """Every pull of a restore ended: it is over (nothing more is written); tell the
        store's breaker, remember the first unreachable object as bad, count, and complete
        the restore's future with the chunks written (the run of good chunks from the first;
        0 if it was given up meanwhile)."""
        with load.lock:
            load.over = True
            load.layer_in.notify_all()
            abandoned = load.abandoned
        load.ended = time.monotonic()
        written = 0
        try:
            written = self._account(load, abandoned)
        except Exception as exc:  # bookkeeping only: the restore still ends
            log.warning("kvcloud: ending the restore of %s: %s", load.spec.req_id, exc)
        finally:
            assert load.future is not None
            # given up meanwhile: reported failed, whatever was written is recomputed
            load.future.set_result(0 if abandoned else written)

    def _account(self, load: Load, abandoned: bool) -> int:
        """What a restore's pulls did: counted, told to the breaker and the memory of bad
        objects. Returns the chunks written: the run of good chunks from the first."""
        spec = load.spec
        good = [False] * load.limit
        unreachable: list[int] = []
        pulled = 0
        for part, res in load.results:
            for j in range(res.chunks):  # each pull's good run from its first chunk
                good[part.start + j] = True
            pulled += res.bytes
            unreachable += [pos for pos, reason in res.failures if reason == "unavailable"]
        written = next((i for i, ok in enumerate(good) if not ok), load.limit)
        for exc in load.errors[:1]:
            log.warning("kvcloud restore of %s failed: %s: recomputing", spec.req_id, exc)
        load.pulled = pulled
        if load.started is not None:  # it ran (one given up still queued never did)
            seconds = load.ended - load.began
            log.debug(
                "kvcloud: pulled %d of %d chunks (%d bytes) for %s in %.0f ms",
                written,
                load.limit,
                pulled,
                spec.req_id,
                1e3 * seconds,
            )
            self.count(
                loads=1,
                load_us=int(1e6 * seconds),
                load_write_us=int(1e6 * load.write_s),
                load_write_cpu_us=int(1e6 * load.write_cpu_s),
                loaded_bytes=pulled,
            )
            in_step = self._in_step_load(spec)
            self.observe("restore_in_step_seconds" if in_step else "restore_seconds", seconds)
            self.observe("restore_bytes", pulled)
            if pulled:
                moved = self._in_step if in_step else self._beside
                with self._meta_lock:
                    moved.bytes += pulled
                    moved.seconds += seconds
        if unreachable:
            first = min(unreachable) - spec.chunks[0].position
            self._remember_bad(spec.chunks[first].object_key)
            self.store_breaker.failure("store errors")
        elif written and not abandoned:
            # (a pull that answered after its deadline was too slow: no proof of health)
            self.store_breaker.success()
        return written

    def _write_layer(
        self, name: str, kv: torch.Tensor, spans: list[tuple[int, int, Blocks]]
    ) -> None:
        """One verified layer of a chunk (``kv``: ``[2, chunk_tokens, heads, dim]``) into its
        blocks: one ``index_copy_`` per span of blocks (one per chunk, as a rule), whatever
        the blocks' order in the cache."""
        bs = self.block_size
        cache, layout = self.caches[name], self.layouts[name]
        for a, b, ids in spans:
            layout.scatter(cache, ids, kv[:, a * bs : b * bs])

    def _outcome(self, load: Load, now: float, force: bool = False) -> int | None:
        """Chunks written for a finished restore; None while it is still running. With
        ``force`` (after the pass, for a restore in the step) it is finished now: given up
        unless its pull is over."""
        future = load.future
        if future is None:
            return 0
        if not future.done():
            if now < load.deadline and not force:
                return None
            if self._expire(load, force):
                return 0
            if not force:
                return None  # its pull is over: the outcome is a moment away
        try:
            # (not done yet only when its pull is over: the rest is bookkeeping)
            return future.result()
        except Exception as exc:  # never into vLLM: the blocks are recomputed instead
            log.warning("kvcloud restore of %s failed: %s: recomputing", load.spec.req_id, exc)
            return 0

    def _settle(self, load: Load, ok: int) -> None:
        """Count a finished restore and note the blocks of its chunks past ``ok`` as failed."""
        real = filled(load.spec)
        failed = [b for ids in real[ok:] for b in ids]
        self._fail_blocks(load, real[ok:])
        if failed and self.whole_failures:
            ok = 0  # the whole request is recomputed
        self.count(
            load_failed_blocks=len(failed),
            loaded_tokens=restored_tokens(load.spec, slice(0, ok), self.block_size),
        )

    def _fail_blocks(self, load: Load, failed: list[list[int]]) -> None:
        """Report the blocks of ``failed`` chunks failed: vLLM recomputes from the first.
        With several KV cache groups or a sliding window (specs.whole_failures) the request
        is reported failed as a whole instead, and recomputed (a miss, counted), never
        partly restored."""
        if not any(failed):
            return
        if self.whole_failures:
            self._failed_requests.add(load.spec.req_id)
            self.count(restores_failed_whole=1)
        else:
            self._failed_blocks.update(b for ids in failed for b in ids)

    def take_failed_requests(self) -> set[str]:
        """Requests whose restore failed (``whole_failures``), since the last call."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed


__all__ = ["Restores"]
