"""Worker side: move KV between kvcloud objects and vLLM's paged blocks.

``WorkerSide`` is where the connector routes vLLM's worker-side calls: it learns the KV layout
(``register_kv_caches``), starts and reports restores (``start_load_kv``,
``wait_for_layer_load``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_worker_meta``), and saves. How a restore runs, fails and is reported: loads.py, the
restore machinery WorkerSide mixes in.

Saves: ``wait_for_save``, which vLLM calls after the forward pass (outside any CUDA graph,
in both model runners), copies every layer of the chunks the step completed straight into a
chunk-sized host buffer (one strided copy per run of blocks, no temporaries; the buffers are
pooled, so a save costs no page faults; on a GPU on the save stream, into pinned memory), and
hands whole chunks to a bounded background uploader with a kvcloud client of its own (its
own connections and threads, so an upload never delays a load), which gives each buffer back
once pushed. ``save_kv_layer`` does nothing: a full CUDA graph replay never calls it, so a
decode-only step would save nothing. Every chunk named for saving is offered to the uploader
or counted (``saves_skipped``); when the uploader's queue is full a chunk is dropped and
counted (``upload_dropped``), never waited for; it pushes object first, entry second. The
copy must happen in the step: vLLM may free and reuse a running request's blocks at the next
schedule (a preemption), so no thread may read them later.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ...client import KVCloud
from ...errors import ConfigError, KVCloudError, LayoutError
from ...namespace import Namespace
from .._torch import to_numpy
from .config import VLLMConnectorConfig
from .device import PassClock, Streams
from .drafters import drafter_layers
from .keys import group_windows
from .layout import BlockLayout, block_index, learn_layout
from .loads import FP8_FORMATS, TORCH_DTYPES, Load, Restores
from .shard import Shard, shard_of
from .specs import NULL_BLOCK, KVCloudWorkerMeta, SaveChunk, SaveSpec, group_ids, whole_failures
from .stats import SideStats
from .uploader import Uploader

if TYPE_CHECKING:
    from .metadata import KVCloudConnectorMetadata

log = logging.getLogger("vllm.kvcloud")


def full_graphs_may_replay(vllm_config: Any) -> bool:
    """Whether a full CUDA graph may replay this engine's forward passes: vLLM's resolved
    ``cudagraph_mode`` has full graphs (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) and the
    model is not run eagerly. A replay executes none of the Python around the attention
    layers, so ``wait_for_layer_load`` and ``save_kv_layer`` do not run in such a step (vLLM
    asks connectors that need them to return True from
    ``requires_piecewise_for_cudagraph``; this one does not need them: docs/VLLM.md)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return False
    model = getattr(vllm_config, "model_config", None)
    return not getattr(model, "enforce_eager", False)


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


def sharing_group(name: str, layer: Any, group_of: dict[str, int]) -> int:
    """The KV cache group of a layer that is in none: one reading another layer's KV
    (vLLM's KV sharing, as in Gemma 3n) joins the groups only after the connector is made;
    its KV is its target's, addressed by the target group's block ids."""
    target = getattr(layer, "kv_sharing_target_layer_name", None)
    if target not in group_of:
        raise ConfigError(f"layer {name} is in no KV cache group (vLLM's kv_cache_groups)")
    return group_of[target]


class WorkerSide(Restores):
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
        # an EAGLE/MTP drafter's layers are saved with the target's (keys.drafter_layers)
        self.drafter = drafter_layers(vllm_config, kv_cache_config) > 0
        super().__init__(cfg, clock)  # the restore machinery's state (loads.py)
        # a full CUDA graph may replay a step: restores in the step are then whole before
        # start_load_kv returns (no per-layer wait runs); a test may set it
        self.full_graphs = full_graphs_may_replay(vllm_config)
        self._stats = SideStats()
        self.upload_client = upload_client
        self.uploader = (
            Uploader(
                upload_client or client,
                ns,
                cfg.upload_queue,
                self.count,
                cfg.upload_nice,
                part=self.shard.heads,
                parts=self.shard.chunk_parts,
                ranges=self.shard.write_ranges(),
                layers=self.shard.layers,
                stages=self.shard.stages,
                observe=self.observe,
            )
            if cfg.write_policy != "off" and self.shard.writer
            else None
        )
        self.caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        # each layer's KV cache group (vLLM's hybrid allocator: a group per kind of layer,
        # each with block ids of its own); every layer in group 0 when there is one
        self.group_of: dict[str, int] = {
            name: g
            for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or [])
            for name in getattr(group, "layer_names", ())
        }
        self.groups = max(1, len(getattr(kv_cache_config, "kv_cache_groups", None) or []))
        self.whole_failures = whole_failures(group_windows(kv_cache_config))
        self.layouts: dict[str, BlockLayout] = {}
        self._pending_saves: list[SaveSpec] = []  # this step's, from start_load_kv
        # the engine's device, learned from its caches (register_kv_caches)
        self.streams = Streams("cpu")
        self._buffers = _BufferPool(
            self._chunk_shape,
            TORCH_DTYPES[ns.dtype],
            cfg.upload_queue,
            alloc=lambda shape, dtype: self.streams.host_empty(shape, dtype),
        )
        self._passes = PassClock()  # forward passes timed for the prefill rate
        self._store_reported_open = False  # to the scheduler side

    def count(self, **deltas: int) -> None:
        self._stats.count(**deltas)

    def observe(self, name: str, value: float) -> None:
        """One observation for the histogram ``name`` (metadata.HISTOGRAMS)."""
        self._stats.observe(name, value)

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len({extract_layer_index(n) for n in names}) != len(names):
            # (a separate draft model numbers its layers from 0 again: no order to store in)
            raise ConfigError(f"vLLM's KV cache layers share layer indices: {names}")
        if len(names) != self.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV cache layers; the model config says "
                f"{self.num_layers} for this rank"
            )
        want = TORCH_DTYPES[self.ns.dtype]
        fp8 = FP8_FORMATS.get(self.ns.dtype)
        context = self.vllm_config.compilation_config.static_forward_context
        num_blocks = int(self.kv_cache_config.num_blocks)
        learned: dict[tuple[Any, ...], BlockLayout] = {}
        for i, name in enumerate(names):
            cache = kv_caches[name]
            if cache.dtype != want:
                raise ConfigError(f"layer {name}: KV cache is {cache.dtype}, expected {want}")
            layer = context[name]
            if self.groups > 1 and name not in self.group_of:
                self.group_of[name] = sharing_group(name, layer, self.group_of)
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
                    fp8=fp8,
                    # (an fp8 cache's op takes the model's dtype and quantizes it)
                    probe_dtype=self.vllm_config.model_config.dtype if fp8 else cache.dtype,
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

    def pass_begins(self, meta: KVCloudConnectorMetadata) -> None:
        """Before the forward pass: time it (to ``wait_for_save``) if it is a prefill's,
        at least a chunk of tokens, none restored in it (a restore in the step would count
        as compute time): the prefill rate the scheduler's cost guard uses."""
        has_restore = any(spec.sync and spec.chunks for spec in meta.loads)
        if meta.tokens >= self.ns.chunk_tokens and not has_restore:
            self._passes.begin(self.streams, meta.tokens)
        else:
            self._passes.cancel()

    def pass_ends(self) -> None:
        """The forward pass's work is issued (V1: ``start_load_kv`` after the pass; V2:
        ``finish_forward``; else ``wait_for_save``): its timer stops here, before sampling
        and a drafter's pass, which are not prefill."""
        self._passes.end()

    def start_load_kv(self, meta: KVCloudConnectorMetadata) -> None:
        """Start this step's restores, and note its saves (copied in ``wait_for_save``).
        Where a full CUDA graph may replay the pass (``full_graphs``), no
        ``wait_for_layer_load`` runs in it: every restore in the step is then written (or
        given up at its deadline) before this returns, and on a GPU the engine's stream
        waits for the writes."""
        # V1 calls this right after the pass in a step with no restore in it (the steps the
        # pass timer times); a step with one calls it before the pass, untimed
        self.pass_ends()
        self._take_saves(meta)
        if self._stepping:  # a step that was never finished (not vLLM's order): settle it
            self._settle_stepping()
        try:
            self._start_loads(meta)
        finally:  # (also when starting raised part of the way: what started is waited for)
            if self.full_graphs and self._stepping:
                self._complete_stepping()

    def _start_loads(self, meta: KVCloudConnectorMetadata) -> None:
        specs = [spec for spec in meta.loads if spec.chunks]
        for spec in meta.loads:
            if not spec.chunks:  # nothing to pull (cannot happen from our scheduler side)
                self._loads[spec.req_id] = Load(spec, 0.0)
        if not specs:
            return
        handed_over = self.streams.mark()
        for spec in specs:
            timeout = self._timeout(spec)
            # until its pull starts, the deadline counts from now (a restore queued here as
            # long as it may run is given up); from its start once it does (loads.py). Its
            # objects stream through the staging ring on the load threads (staging.py)
            load = Load(spec, self._clock() + timeout, after=handed_over, timeout=timeout)
            load.written = [0] * self.num_layers
            if self._in_step_load(spec):
                self._stepping.append(load)
            else:
                self._loads[spec.req_id] = load
            load.limit = (
                0
                if spec.refused
                else next(
                    (i for i, ch in enumerate(spec.chunks) if self._is_bad(ch.object_key)),
                    len(spec.chunks),
                )
            )
            if load.limit == 0 or not self.store_breaker.allow():
                self.count(loads_refused=1)
                continue  # no future: reported failed at the next get_finished
            self._submit(load)

    def fail_loads(self, meta: KVCloudConnectorMetadata) -> None:
        """``start_load_kv`` raised part of the way: every load of the step it did not
        register is reported failed (its blocks recomputed), so no request waits forever."""
        stepping = {load.spec.req_id for load in self._stepping}
        for spec in meta.loads:
            if spec.req_id in self._loads or spec.req_id in stepping:
                continue
            load = Load(spec, 0.0)  # no future: failed, nothing written
            if self._in_step_load(spec):
                self._stepping.append(load)  # its blocks reported failed after the step
            else:
                self._loads[spec.req_id] = load  # reported finished (failed) at once

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
            # past its deadline: given up now, before the pass reads this layer, so nothing
            # more is written under its reads (reported failed after the step); waited for
            # again if its pull just started (a later deadline) or just ended
            while not self._layer_written(load, layer) and not self._expire(load):
                pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The restores that are over (done, failed or abandoned), their failed blocks noted
        for ``get_block_ids_with_load_errors`` in this same pass; first the restores of this
        step's forward pass, whose failures are reported now too.

        Called after the pass in the same step. Where vLLM defers ``wait_for_save`` past
        a drafter (V1 with speculative decoding), a pipeline stage other than the last
        returns before it ever runs: the step's saves are copied here, while their blocks
        still hold this step's KV (by the next step a finished request's blocks may be
        someone else's)."""
        if self._pending_saves and not self.drafter:
            # (with a drafter's KV layers, wait_for_save runs after the drafter wrote them)
            chunks = sum(len(spec.chunks) for spec in self._pending_saves)
            try:
                self.wait_for_save()
            except Exception as exc:  # the restores below must still be reported
                log.warning("kvcloud: could not copy this step's saves: %s", exc)
                self.count(saves_skipped=chunks)
        if self._stepping:
            self._settle_stepping()
        if not self._loads:
            return None, None
        now = self._clock()
        done: set[str] = set()
        for req_id, load in list(self._loads.items()):
            try:
                ok = self._outcome(load, now)
                if ok is None:
                    continue
                if load.ended:
                    self.count(load_report_us=int(1e6 * max(0.0, time.monotonic() - load.ended)))
                self._settle(load, ok)
            except Exception as exc:
                # reported all failed rather than never: a request whose restore is never
                # reported waits in WAITING_FOR_REMOTE_KVS forever
                self._fail_all(load, exc)
            done.add(req_id)
            del self._loads[req_id]
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_worker_meta(self) -> KVCloudWorkerMeta | None:
        """Tell the scheduler side what it should stop offering (only when it changed), and
        how fast the restores that ended since the last report ran."""
        with self._meta_lock:
            bad, self._new_bad = self._new_bad, {}
            (in_bytes, in_s), (beside_bytes, beside_s) = self._in_step.take(), self._beside.take()
            given_up_bytes, given_up_s = self._given_up.take()
        pass_tokens, pass_s = self._passes.take()
        retry_in = self.store_breaker.retry_in()
        is_open = self.store_breaker.is_open
        changed = is_open != self._store_reported_open
        self._store_reported_open = is_open
        if not (bad or changed or in_bytes or beside_bytes or given_up_s or pass_tokens):
            return None
        return KVCloudWorkerMeta(
            bad_objects=bad,
            store_retry_in=retry_in if is_open else 0.0,
            store_ok=not is_open,
            in_step_bytes=in_bytes,
            in_step_s=in_s,
            beside_bytes=beside_bytes,
            beside_s=beside_s,
            pass_tokens=pass_tokens,
            pass_s=pass_s,
            given_up_bytes=given_up_bytes,
            given_up_s=given_up_s,
        )

    # -- saves ------------------------------------------------------------------------------

    def save_kv_layer(
        self, meta: KVCloudConnectorMetadata, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
        """Nothing: a full CUDA graph replay never calls it (it runs in a Python wrapper
        around the attention op), so every step's saves are copied in ``wait_for_save``."""

    def _take_saves(self, meta: KVCloudConnectorMetadata) -> None:
        """From ``start_load_kv``, which vLLM calls every step before ``wait_for_save``
        (before or after the pass): the step's saves, copied in ``wait_for_save``. (The
        connector hands ``wait_for_save`` no metadata.)"""
        if self._pending_saves:  # a step without wait_for_save (not vLLM's order)
            self.count(saves_skipped=sum(len(spec.chunks) for spec in self._pending_saves))
        self._pending_saves = list(meta.saves) if self.uploader is not None else []

    def wait_for_save(self) -> None:
        """After the forward pass, outside any CUDA graph: copy every layer of each chunk
        the step completed out of vLLM's blocks into a pooled host buffer (on a GPU on the
        save stream, after the pass's kernels; later kernels wait for the copies), and offer
        it to the uploader, which waits for the copy before reading it. A chunk that cannot
        be copied whole is counted as ``saves_skipped``, never offered."""
        self._passes.end()  # (before the copies: they are kvcloud's time, not the pass's)
        saves, self._pending_saves = self._pending_saves, []
        if self.uploader is None or not saves:
            return
        started = time.monotonic()
        device = self.streams.device
        layers = sorted(self.layer_index.items(), key=lambda item: item[1])
        copies: list[tuple[SaveSpec, SaveChunk, torch.Tensor]] = []
        skipped = dropped = 0
        room = self.uploader.room()
        with self.streams.saving():
            for spec in saves:
                for ch in spec.chunks:
                    groups = group_ids(ch)
                    if any(b == NULL_BLOCK for ids in groups for b in ids):
                        skipped += 1  # partly out of a sliding window: not whole
                        continue
                    if room <= 0:
                        dropped += 1  # the queue is full: not even copied
                        continue
                    room -= 1
                    buf = self._buffers.take()
                    try:
                        # made on the save stream, which uses it
                        index = [block_index(ids, device) for ids in groups]
                        for name, layer in layers:
                            ids = index[self.group_of.get(name, 0)]
                            self.layouts[name].gather_into(self.caches[name], ids, buf[layer])
                    except (LayoutError, RuntimeError, IndexError) as exc:
                        log.warning("kvcloud: could not read chunk %d of %s for saving: %s",
                                    ch.position, spec.req_id, exc)  # fmt: skip
                        self._buffers.give(buf)
                        skipped += 1
                        continue
                    copies.append((spec, ch, buf))
        copied = self.streams.after_save()
        took = time.monotonic() - started
        self.count(save_us=int(1e6 * took))
        self.observe("save_seconds", took)
        if skipped:
            self.count(saves_skipped=skipped)
        if dropped:
            self.count(upload_dropped=dropped)
        for spec, ch, buf in copies:
            offered = self.uploader.offer(
                spec.tenant,
                ch.fp,
                ch.parent,
                to_numpy(buf),
                done=lambda buf=buf: self._buffers.give(buf),
                ready=copied.wait,
            )
            if not offered:  # the queue is full: counted as upload_dropped
                self._buffers.give(buf)

    # -- stats and shutdown -----------------------------------------------------------------

    def take_stats(self) -> dict[str, Any]:
        return self._stats.take(
            {
                "store_breaker_open": int(self.store_breaker.is_open),
                "upload_queue_depth": self.uploader.depth() if self.uploader is not None else 0,
                "restores_in_flight": self.restores_in_flight(),
            }
        )

    def drain_budget(self) -> float:
        """Seconds the uploader may push at stop: ``drain_seconds``, within the windows this
        vLLM gives a stopping worker (``uploader.stop_budget``)."""
        from .uploader import stop_budget, worker_stop_timeout

        return stop_budget(
            self.cfg.drain_seconds,
            float(getattr(self.vllm_config, "shutdown_timeout", 0) or 0),
            worker_stop_timeout(),
        )

    def shutdown(self) -> None:
        """vLLM's stop: ``Worker.shutdown`` calls ``ensure_kv_transfer_shutdown``, which
        calls this, in the ``finally`` a worker process runs on its way out (after SIGTERM,
        or its engine core closing its death pipe: ``WorkerProc.worker_main``), and from
        ``EngineCore.shutdown`` where the worker runs in the engine's process. So the drain
        hangs on this call, not on an atexit handler (by then concurrent.futures refuses
        new work to the client's transfer pool) nor on a SIGTERM handler (a worker need not
        get one: under Kubernetes only the API server does, and the worker learns of the
        stop from its death pipe). The uploader pushes what is still queued for as long as
        vLLM lets this worker live (``drain_budget``), then gives up on the rest, logged and
        counted."""
        dropped = 0
        if self.uploader is not None:
            dropped = self.uploader.close(self.drain_budget())
        self._pool.shutdown(wait=False, cancel_futures=True)
        # a push still under way past the budget keeps its client open: closing it would
        # wait for that push (its transfer pool), past what vLLM allows
        busy = self.uploader.client if dropped and self.uploader is not None else None
        for client in (self.client, self.upload_client):
            if client is None or client is busy:
                continue
            try:
                client.close()
            except KVCloudError as exc:
                log.warning("kvcloud: closing the client: %s", exc)
