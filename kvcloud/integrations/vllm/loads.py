"""Restores: pull kvcloud objects into staging and write them, verified, into vLLM's blocks.

A restore runs beside the forward pass unless the scheduler side put it in the step (its
spec says ``sync``: ``load_mode=sync``, or ``auto`` when measured short), so a slow store
makes no forward pass wait beyond that. ``start_load_kv`` hands each restore to
a load thread, which pulls every matched object in parallel, each streamed straight into its own
slice of a staging array in kvcloud's layout and hashed as it lands, and writes each layer of
each chunk into the request's blocks as soon as that layer is verified — blocks no forward pass
reads until vLLM is told the load is over (or, in the step, until that layer is written).
After each step ``get_finished`` reports the restores that are over: done, or past
``load_timeout`` (then abandoned: the thread may finish pulling into staging, but it can
no longer touch vLLM's blocks). A chunk that is missing, corrupt, late or unreachable — and
every chunk after it — is reported through ``get_block_ids_with_load_errors`` in that same
pass, before the request is ever scheduled, so vLLM recomputes exactly those tokens. For a
restore in the step, ``start_load_kv`` returns at once and ``wait_for_layer_load(layer)``
waits until that layer of every such restore is written (at most until its deadline:
``load_timeout``, or four ``sync_budget_ms`` for one ``auto`` put there), so layer 0 computes
while later layers are still arriving; a restore past its deadline is abandoned between two
layer writes, and its failed blocks are reported after that same step (vLLM then discards
the step's output for the request and recomputes).
No byte reaches vLLM's cache before it is verified: each layer of a chunk is checked against
its digest in the header before it is written (DESIGN §4.3); the blocks of a chunk whose later
layer fails are reported for recompute with it. Nothing here raises into vLLM.

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
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...client import ChunkRef, Match
from ...indexes.base import IndexEntry
from .._torch import to_numpy
from .device import PASSED, Fence
from .layout import Blocks, block_index
from .specs import NULL_BLOCK, LoadSpec

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
}


@dataclass
class Load:
    spec: LoadSpec
    staging: torch.Tensor  # [chunks, layers, 2, chunk_tokens, heads, dim]
    deadline: float
    future: cf.Future[int] | None = None  # chunks verified and written into vLLM's blocks
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

    def __post_init__(self) -> None:
        self.layer_in = threading.Condition(self.lock)


def _spans(block_ids: list[int]) -> list[tuple[int, int]]:
    """The runs of a chunk's block slots to write: blocks vLLM already holds (-1, a prefix)
    and a sliding window's null blocks are skipped. Usually one span, the whole chunk or its
    tail after vLLM's own prefix hit."""
    spans: list[tuple[int, int]] = []
    for k, b in enumerate(block_ids):
        if b < 0 or b == NULL_BLOCK:
            continue
        if spans and spans[-1][1] == k:
            spans[-1] = (spans[-1][0], k + 1)
        else:
            spans.append((k, k + 1))
    return spans


@dataclass
class _Moved:
    bytes: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, float]:
        out = (self.bytes, self.seconds)
        self.bytes, self.seconds = 0, 0.0
        return out


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
    layouts: dict[str, BlockLayout]
    _chunk_shape: tuple[int, ...]
    count: Callable[..., None]

    def __init__(self, cfg: VLLMConnectorConfig, clock: Any) -> None:
        self._clock = clock
        self._pool = cf.ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="kvcloud-load")
        self._loads: dict[str, Load] = {}  # by request id, until reported finished
        # restores the forward pass of this step reads (load_mode=sync, or auto when short):
        # it waits for each layer (wait_for_layer_load); they are settled after the pass
        self._stepping: list[Load] = []
        self._kept: torch.Tensor | None = None  # staging reused across restores
        self._kept_users: list[Load] = []
        self._failed_blocks: set[int] = set()
        self.store_breaker = cfg.breaker("store", clock, self._breaker_changed)
        self._bad_objects: dict[str, float] = {}  # object key -> until (clock)
        self._new_bad: dict[str, float] = {}  # not yet reported to the scheduler
        self._meta_lock = threading.Lock()
        # restores ended since the last report: bytes and seconds, in the step and beside it
        self._in_step = _Moved()
        self._beside = _Moved()

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            self.count(store_breaker_opened=1)

    def _in_step_load(self, spec: LoadSpec) -> bool:
        # the scheduler side decides (``spec.sync``); the worker's own setting only counts
        # for specs built without it (tests, or a scheduler side older than the worker)
        return spec.sync or self.cfg.load_mode == "sync"

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
        futures = [load.future for load in loads if load.future is not None]
        if futures:
            latest = max(load.deadline for load in loads)
            cf.wait(futures, timeout=max(0.0, latest - self._clock()))
        for load in loads:
            now = self._clock()
            ok = self._outcome(load, max(now, load.deadline))
            self._settle(load, ok or 0)

    def _is_bad(self, key: str) -> bool:
        with self._meta_lock:
            until = self._bad_objects.get(key)
            if until is None:
                return False
            if until <= self._clock():
                del self._bad_objects[key]
                return False
            return True

    def _remember_bad(self, key: str) -> None:
        until = self._clock() + self.cfg.failure_memory
        with self._meta_lock:
            self._bad_objects[key] = until
            self._new_bad[key] = self.cfg.failure_memory

    def _staging(self, n_chunks: int) -> torch.Tensor:
        """Room for ``n_chunks`` pulled chunks: the kept buffer when it is free and big
        enough (an abandoned pull may still be writing into it), else fresh memory."""
        shape = (n_chunks, *self._chunk_shape)
        dtype = TORCH_DTYPES[self.ns.dtype]
        free = all(load.future is None or load.future.done() for load in self._kept_users)
        if free:
            self._kept_users = []
            kept = self._kept
            if kept is not None and kept.shape[0] >= n_chunks:
                return kept[:n_chunks]
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes <= self.cfg.staging_mib << 20:
                self._kept = self.streams.host_empty(shape, dtype)
                return self._kept
        return self.streams.host_empty(shape, dtype)

    def _restore(self, load: Load) -> int:
        """On a load thread: pull and verify into staging, then write into vLLM's blocks
        unless the restore was abandoned meanwhile. Returns the chunks written."""
        spec = load.spec
        c = self.ns.chunk_tokens
        refs = tuple(
            ChunkRef(ch.position, ch.fp, ch.parent, IndexEntry(ch.object_key, c, ch.size, 0.0))
            for ch in spec.chunks[: load.limit]
        )
        m = Match(self.ns, spec.tenant, refs, refs[-1].position + 1)
        started = time.monotonic()
        try:
            return self._pull_and_write(load, m)
        finally:
            load.ended = time.monotonic()
            self.count(loads=1, load_us=int(1e6 * (load.ended - started)))
            if load.pulled:
                moved = self._in_step if self._in_step_load(spec) else self._beside
                with self._meta_lock:
                    moved.bytes += load.pulled
                    moved.seconds += load.ended - started

    def _pull_and_write(self, load: Load, m: Match) -> int:
        """Pull the chunks; each layer of each chunk is written into its blocks as soon as it
        is verified (object format 3 verifies layer by layer), so the forward pass of a
        restore in the step can run layer l while later layers are still in flight."""
        spec = load.spec
        started = time.monotonic()
        device = self.streams.device
        targets = [
            [(a, b, block_index(ch.block_ids[a:b], device)) for a, b in _spans(ch.block_ids)]
            for ch in spec.chunks[: load.limit]
        ]
        names = {layer: name for name, layer in self.layer_index.items()}
        write_s = 0.0

        def write(i: int, layer: int) -> None:
            nonlocal write_s
            with load.lock:  # writes are serialized, so their seconds add up to wall time
                if load.abandoned:
                    return  # vLLM may have given the blocks to another request
                t0 = time.monotonic()
                with self.streams.loading(load.after):
                    self._write_layer(load, names[layer], i, layer, targets[i])
                write_s += time.monotonic() - t0
                load.written[layer] += 1
                load.layer_in.notify_all()

        try:
            res = self.client.pull_into(
                m,
                list(to_numpy(load.staging[: load.limit])),
                heads=self.shard.heads,
                layers=self.shard.layers,
                on_layer=write,
            )
        finally:
            with load.lock:
                load.over = True
                load.layer_in.notify_all()
        log.debug(
            "kvcloud: pulled %d of %d chunks (%d bytes) for %s in %.0f ms",
            res.chunks,
            len(m.chunks),
            res.bytes,
            spec.req_id,
            1e3 * (time.monotonic() - started),
        )
        self.count(loaded_bytes=res.bytes)
        load.pulled = res.bytes
        unreachable = [pos for pos, reason in res.failures if reason == "unavailable"]
        with load.lock:
            abandoned = load.abandoned
        if unreachable:
            first = unreachable[0] - spec.chunks[0].position
            self._remember_bad(spec.chunks[first].object_key)
            self.store_breaker.failure("store errors")
        elif res.chunks and not abandoned:
            # (a pull that answered after its deadline was too slow: no proof of health)
            self.store_breaker.success()
        self.count(load_write_us=int(1e6 * write_s))
        # abandoned meanwhile: reported failed, whatever was written is recomputed
        return 0 if abandoned else res.chunks

    def _write_layer(
        self, load: Load, name: str, i: int, layer: int, spans: list[tuple[int, int, Blocks]]
    ) -> None:
        """One verified layer of chunk ``i`` into its blocks: one ``index_copy_`` per span of
        blocks (one per chunk, as a rule), whatever the blocks' order in the cache."""
        bs = self.block_size
        cache, layout = self.caches[name], self.layouts[name]
        kv = load.staging[i, layer]  # [2, chunk_tokens, heads, dim]
        for a, b, ids in spans:
            layout.scatter(cache, ids, kv[:, a * bs : b * bs])

    def _outcome(self, load: Load, now: float) -> int | None:
        """Chunks written for a finished restore; None while it is still running."""
        future = load.future
        if future is None:
            return 0
        if not future.done():
            if now < load.deadline:
                return None
            with load.lock:
                # taken between two layer writes: none is written after this (vLLM may give
                # the blocks to another request), whatever was is recomputed
                load.abandoned = True
            log.warning(
                "kvcloud restore of %s ran past its timeout (%.2fs): recomputing",
                load.spec.req_id,
                self._timeout(load.spec),
            )
            self.count(load_timeouts=1)
            self._remember_bad(load.spec.chunks[0].object_key)
            self.store_breaker.failure("restore timed out", timeout=True)
            return 0
        try:
            return future.result()
        except Exception as exc:  # never into vLLM: the blocks are recomputed instead
            log.warning("kvcloud restore of %s failed: %s: recomputing", load.spec.req_id, exc)
            return 0

    def _settle(self, load: Load, ok: int) -> None:
        """Count a finished restore and note the blocks of its chunks past ``ok`` as failed."""
        chunks = load.spec.chunks
        real = [[b for b in ch.block_ids if b >= 0 and b != NULL_BLOCK] for ch in chunks]
        failed = [b for ids in real[ok:] for b in ids]
        loaded = sum(len(ids) for ids in real[:ok])
        self._failed_blocks.update(failed)
        self.count(load_failed_blocks=len(failed), loaded_tokens=loaded * self.block_size)


__all__ = ["Restores"]
