"""Worker side: move KV between kvcloud objects and vLLM's paged blocks.

A restore runs beside the forward pass unless the scheduler side put it in the step (its
spec says ``sync``: ``load_mode=sync``, or ``auto`` when measured short), so a slow store
makes no forward pass wait beyond that. ``start_load_kv`` hands each restore to
a load thread, which pulls every matched object in parallel, each streamed straight into its own
slice of a staging array in kvcloud's layout and hashed as it lands, and then writes the
verified chunks into the request's blocks — blocks no forward pass reads until vLLM is told the
load is over. After each step ``get_finished`` reports the restores that are over: done, or
past ``load_timeout`` (then abandoned: the thread may finish pulling into staging, but it can
no longer touch vLLM's blocks). A chunk that is missing, corrupt, late or unreachable — and
every chunk after it — is reported through ``get_block_ids_with_load_errors`` in that same
pass, before the request is ever scheduled, so vLLM recomputes exactly those tokens. For a
restore in the step, ``start_load_kv`` itself waits (at most ``load_timeout``; four
``sync_budget_ms`` for one ``auto`` put there) before the forward pass reads it, and its
failed blocks are reported after that same step (vLLM then discards the step's output for
the request and recomputes).
No byte of a chunk reaches vLLM's cache before the chunk is verified (DESIGN §4.3). Nothing
here raises into vLLM.

A circuit breaker on the store, and a memory of objects whose pull failed or timed out,
keep a sick store from costing every request a timeout; both are reported to the scheduler
side (``build_connector_worker_meta``) so it stops offering such loads at all.

Saves: ``save_kv_layer`` copies each layer's slice of the chunks the step completed straight
into a chunk-sized host buffer right after the layer ran (one strided copy per run of blocks,
no temporaries; the buffers are pooled, so a save costs no page faults); ``wait_for_save``
hands whole chunks to a bounded background uploader with a kvcloud client of its own (its own
connections and threads, so an upload never delays a load), which gives each buffer back once
pushed. When its queue is full a chunk is dropped and counted, never waited for; it pushes
object first, entry second. The copy must happen in the step: vLLM may free and reuse a
running request's blocks at the next schedule (a preemption), so no thread may read them
later.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...client import ChunkRef, KVCloud, Match
from ...errors import ConfigError, KVCloudError, LayoutError
from ...indexes.base import IndexEntry
from ...namespace import Namespace
from .._torch import to_numpy
from .config import VLLMConnectorConfig
from .device import PASSED, Fence, Streams
from .layout import BlockLayout, Blocks, block_index, learn_layout
from .shard import Shard, shard_of
from .specs import NULL_BLOCK, KVCloudWorkerMeta, LoadSpec, SaveSpec
from .uploader import Uploader

if TYPE_CHECKING:
    from .metadata import KVCloudConnectorMetadata

log = logging.getLogger("vllm.kvcloud")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class _Load:
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


@dataclass
class _Save:
    spec: SaveSpec
    staging: list[torch.Tensor]  # one [layers, 2, chunk_tokens, heads, dim] per chunk
    ids: list[torch.Tensor]  # each chunk's block ids, on the cache's device
    layers_done: set[int] = field(default_factory=set)


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


class _BufferPool:
    """Chunk-sized host buffers for saves, given back by the uploader once pushed: fresh
    memory costs page faults on first touch (several ms per chunk), reused memory does not.
    At most ``keep`` idle buffers are kept; the uploader's queue bounds those in use."""

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, keep: int, alloc: Any = None
    ) -> None:
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self.alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self.alloc(self.shape, self.dtype)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


@dataclass
class _Moved:
    bytes: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, float]:
        out = (self.bytes, self.seconds)
        self.bytes, self.seconds = 0, 0.0
        return out


class WorkerSide:
    def __init__(
        self,
        cfg: VLLMConnectorConfig,
        ns: Namespace,
        client: KVCloud,
        vllm_config: Any,
        kv_cache_config: Any,
        upload_client: KVCloud | None = None,
        clock: Any = time.monotonic,
        shard: Shard | None = None,
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        # the KV heads this rank holds (all of them at TP 1): what it pulls, stores, stages
        self.shard = shard or shard_of(0, 1, ns.num_kv_heads)
        # the layers this rank holds: its pipeline stage's (every layer without PP)
        self.num_layers = self.shard.num_layers(ns.num_layers)
        self._chunk_shape = (
            self.num_layers,
            2,
            ns.chunk_tokens,
            self.shard.num_heads,
            ns.head_dim,
        )

        self.client = client
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self._clock = clock
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self.upload_client = upload_client
        self.uploader = (
            Uploader(
                upload_client or client,
                ns,
                cfg.upload_queue,
                self.count,
                cfg.upload_nice,
                part=self.shard.heads,
                parts=self.shard.parts,
                layers=self.shard.layers,
                stages=self.shard.stages,
            )
            if cfg.write_policy != "off" and self.shard.writer
            else None
        )
        self._pool = cf.ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="kvcloud-load")
        self.caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.layouts: dict[str, BlockLayout] = {}
        self._loads: dict[str, _Load] = {}  # by request id, until reported finished
        # restores the forward pass of this step reads (load_mode=sync, or auto when short):
        # it waits for each layer (wait_for_layer_load); they are settled after the pass
        self._stepping: list[_Load] = []
        self._kept: torch.Tensor | None = None  # staging reused across restores
        self._kept_users: list[_Load] = []
        self._saves: list[_Save] = []
        # the engine's device, learned from its caches (register_kv_caches)
        self.streams = Streams("cpu")
        self._buffers = _BufferPool(
            self._chunk_shape,
            _TORCH_DTYPES[ns.dtype],
            cfg.upload_queue,
            alloc=lambda shape, dtype: self.streams.host_empty(shape, dtype),
        )
        self._failed_blocks: set[int] = set()
        self.store_breaker = cfg.breaker("store", clock, self._breaker_changed)
        self._bad_objects: dict[str, float] = {}  # object key -> until (clock)
        self._new_bad: dict[str, float] = {}  # not yet reported to the scheduler
        self._store_reported_open = False  # to the scheduler side
        self._store_gauge = 0  # last value of the store_breaker_open gauge reported
        self._meta_lock = threading.Lock()
        # restores ended since the last report: bytes and seconds, in the step and beside it
        self._in_step = _Moved()
        self._beside = _Moved()

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            self.count(store_breaker_opened=1)

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            self.stats.update(deltas)

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV cache layers; the model config says "
                f"{self.num_layers} for this rank"
            )
        want = _TORCH_DTYPES[self.ns.dtype]
        context = self.vllm_config.compilation_config.static_forward_context
        num_blocks = int(self.kv_cache_config.num_blocks)
        learned: dict[tuple[Any, ...], BlockLayout] = {}
        for i, name in enumerate(names):
            cache = kv_caches[name]
            if cache.dtype != want:
                raise ConfigError(f"layer {name}: KV cache is {cache.dtype}, expected {want}")
            layer = context[name]
            key = (tuple(cache.shape), cache.stride(), cache.dtype, type(layer.impl).__name__)
            layout = learned.get(key)
            if layout is None:
                layout = learned[key] = learn_layout(
                    layer,
                    cache,
                    num_blocks,
                    self.block_size,
                    self.shard.num_heads,
                    self.ns.head_dim,
                )
            self.caches[name] = cache
            self.layer_index[name] = i
            self.layouts[name] = layout
        first = self.layouts[names[0]]
        self.streams = Streams(kv_caches[names[0]].device)
        log.info(
            "kvcloud: learned vLLM's KV layout: cache %s %s, block axis %d, %s block interior",
            list(kv_caches[names[0]].shape),
            str(want).removeprefix("torch."),
            first.block_dim,
            "natural" if first.natural else "permuted",
        )

    # -- loads ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVCloudConnectorMetadata) -> None:
        if self._stepping:  # a step that was never finished (not vLLM's order): settle it
            self._settle_stepping()
        specs = [spec for spec in meta.loads if spec.chunks]
        for spec in meta.loads:
            if not spec.chunks:  # nothing to pull (cannot happen from our scheduler side)
                self._loads[spec.req_id] = _Load(spec, torch.empty(0), 0.0)
        if not specs:
            return
        buf = self._staging(sum(len(spec.chunks) for spec in specs))
        shared = self._kept is not None and buf.data_ptr() == self._kept.data_ptr()
        first = 0
        handed_over = self.streams.mark()
        for spec in specs:
            # one contiguous [layers, 2, chunk_tokens, heads, dim] per chunk, so each
            # object streams straight in and is hashed as it lands
            staging = buf[first : first + len(spec.chunks)]
            first += len(spec.chunks)
            load = _Load(spec, staging, self._clock() + self._timeout(spec), after=handed_over)
            load.written = [0] * self.num_layers
            if self._in_step_load(spec):
                self._stepping.append(load)
            else:
                self._loads[spec.req_id] = load
            if shared:
                self._kept_users.append(load)
            load.limit = next(
                (i for i, ch in enumerate(spec.chunks) if self._is_bad(ch.object_key)),
                len(spec.chunks),
            )
            if load.limit == 0 or not self.store_breaker.allow():
                self.count(loads_refused=1)
                continue  # no future: reported failed at the next get_finished
            load.future = self._pool.submit(self._restore, load)

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
        dtype = _TORCH_DTYPES[self.ns.dtype]
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

    def _restore(self, load: _Load) -> int:
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

    def _pull_and_write(self, load: _Load, m: Match) -> int:
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
        self, load: _Load, name: str, i: int, layer: int, spans: list[tuple[int, int, Blocks]]
    ) -> None:
        """One verified layer of chunk ``i`` into its blocks: one ``index_copy_`` per span of
        blocks (one per chunk, as a rule), whatever the blocks' order in the cache."""
        bs = self.block_size
        cache, layout = self.caches[name], self.layouts[name]
        kv = load.staging[i, layer]  # [2, chunk_tokens, heads, dim]
        for a, b, ids in spans:
            layout.scatter(cache, ids, kv[:, a * bs : b * bs])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by vLLM's attention before it reads a layer: block until every restore in
        this step has written that layer of each chunk (or is over: what failed is reported
        after the step), at most until its deadline. Restores beside the pass are never
        read before vLLM hears they finished, and are not waited for."""
        layer = self.layer_index.get(layer_name)
        if layer is None or not self._stepping:
            return
        for load in self._stepping:
            if load.future is None:
                continue  # refused: nothing will be written
            with load.lock:
                while not (load.over or load.abandoned or load.written[layer] >= load.limit):
                    left = load.deadline - self._clock()
                    if left <= 0:
                        break  # abandoned when the step is settled; reported failed
                    load.layer_in.wait(left)

    def _outcome(self, load: _Load, now: float) -> int | None:
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The restores that are over (done, failed or abandoned), their failed blocks noted
        for ``get_block_ids_with_load_errors`` in this same pass; first the restores of this
        step's forward pass, whose failures are reported now too."""
        if self._stepping:
            self._settle_stepping()
        if not self._loads:
            return None, None
        now = self._clock()
        done: set[str] = set()
        for req_id, load in list(self._loads.items()):
            ok = self._outcome(load, now)
            if ok is None:
                continue
            if load.ended:
                self.count(load_report_us=int(1e6 * max(0.0, time.monotonic() - load.ended)))
            self._settle(load, ok)
            done.add(req_id)
            del self._loads[req_id]
        return None, (done or None)

    def _settle(self, load: _Load, ok: int) -> None:
        """Count a finished restore and note the blocks of its chunks past ``ok`` as failed."""
        chunks = load.spec.chunks
        real = [[b for b in ch.block_ids if b >= 0 and b != NULL_BLOCK] for ch in chunks]
        failed = [b for ids in real[ok:] for b in ids]
        loaded = sum(len(ids) for ids in real[:ok])
        self._failed_blocks.update(failed)
        self.count(load_failed_blocks=len(failed), loaded_tokens=loaded * self.block_size)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_worker_meta(self) -> KVCloudWorkerMeta | None:
        """Tell the scheduler side what it should stop offering (only when it changed), and
        how fast the restores that ended since the last report ran."""
        with self._meta_lock:
            bad, self._new_bad = self._new_bad, {}
            (in_bytes, in_s), (beside_bytes, beside_s) = self._in_step.take(), self._beside.take()
        retry_in = self.store_breaker.retry_in()
        is_open = self.store_breaker.is_open
        changed = is_open != self._store_reported_open
        self._store_reported_open = is_open
        if not bad and not changed and not in_bytes and not beside_bytes:
            return None
        return KVCloudWorkerMeta(
            bad_objects=bad,
            store_retry_in=retry_in if is_open else 0.0,
            store_ok=not is_open,
            in_step_bytes=in_bytes,
            in_step_s=in_s,
            beside_bytes=beside_bytes,
            beside_s=beside_s,
        )

    # -- saves ------------------------------------------------------------------------------

    def save_kv_layer(
        self, meta: KVCloudConnectorMetadata, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
        if self.uploader is None or not meta.saves or layer_name not in self.layer_index:
            return
        if not self._saves:
            device = self.streams.device
            self._saves = [
                _Save(
                    spec,
                    [self._buffers.take() for _ in spec.chunks],
                    [block_index(ch.block_ids, device) for ch in spec.chunks],
                )
                for spec in meta.saves
                # a chunk partly out of a sliding window is not whole: not saved
                if not any(b == NULL_BLOCK for ch in spec.chunks for b in ch.block_ids)
            ]
        layer = self.layer_index[layer_name]
        layout = self.layouts[layer_name]
        started = time.monotonic()
        with self.streams.saving():
            for save in self._saves:
                try:
                    for ids, staging in zip(save.ids, save.staging, strict=True):
                        layout.gather_into(kv_layer, ids, staging[layer])
                    save.layers_done.add(layer)
                except (LayoutError, RuntimeError, IndexError) as exc:
                    log.warning("kvcloud: could not read %s for saving: %s", layer_name, exc)
        self.count(save_us=int(1e6 * (time.monotonic() - started)))

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, []
        if self.uploader is None or not saves:
            return
        copied = self.streams.after_save()
        for save in saves:
            whole = len(save.layers_done) == self.num_layers
            for ch, staging in zip(save.spec.chunks, save.staging, strict=True):
                if not (
                    whole
                    and self.uploader.offer(
                        save.spec.tenant,
                        ch.fp,
                        ch.parent,
                        to_numpy(staging),
                        done=lambda buf=staging: self._buffers.give(buf),
                        ready=copied.wait,
                    )
                ):
                    self._buffers.give(staging)

    # -- stats and shutdown -----------------------------------------------------------------

    def take_stats(self) -> dict[str, int]:
        with self._stats_lock:
            out = dict(self.stats)
            self.stats.clear()
        gauge = int(self.store_breaker.is_open)
        if gauge != self._store_gauge:
            out["store_breaker_open"] = self._store_gauge = gauge
        return out

    def shutdown(self) -> None:
        if self.uploader is not None:
            self.uploader.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in (self.client, self.upload_client):
            if client is None:
                continue
            try:
                client.close()
            except KVCloudError as exc:
                log.warning("kvcloud: closing the client: %s", exc)
