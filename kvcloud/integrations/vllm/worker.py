"""Worker side: move KV between kvcloud objects and vLLM's paged blocks.

``WorkerSide`` is where the connector routes vLLM's worker-side calls: it learns the KV layout
(``register_kv_caches``), starts and reports restores (``start_load_kv``,
``wait_for_layer_load``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_worker_meta``), and saves. How a restore runs, fails and is reported: loads.py, the
restore machinery WorkerSide mixes in.

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

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...client import KVCloud
from ...errors import ConfigError, KVCloudError, LayoutError
from ...namespace import Namespace
from .._torch import to_numpy
from .config import VLLMConnectorConfig
from .device import Streams
from .layout import BlockLayout, block_index, learn_layout
from .loads import TORCH_DTYPES, Load, Restores
from .shard import Shard, shard_of
from .specs import NULL_BLOCK, KVCloudWorkerMeta, SaveSpec
from .uploader import Uploader

if TYPE_CHECKING:
    from .metadata import KVCloudConnectorMetadata

log = logging.getLogger("vllm.kvcloud")


@dataclass
class _Save:
    spec: SaveSpec
    staging: list[torch.Tensor]  # one [layers, 2, chunk_tokens, heads, dim] per chunk
    ids: list[torch.Tensor]  # each chunk's block ids, on the cache's device
    layers_done: set[int] = field(default_factory=set)


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
        super().__init__(cfg, clock)  # the restore machinery's state (loads.py)
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
        self.caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.layouts: dict[str, BlockLayout] = {}
        self._saves: list[_Save] = []
        # the engine's device, learned from its caches (register_kv_caches)
        self.streams = Streams("cpu")
        self._buffers = _BufferPool(
            self._chunk_shape,
            TORCH_DTYPES[ns.dtype],
            cfg.upload_queue,
            alloc=lambda shape, dtype: self.streams.host_empty(shape, dtype),
        )
        self._store_reported_open = False  # to the scheduler side
        self._store_gauge = 0  # last value of the store_breaker_open gauge reported

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
        want = TORCH_DTYPES[self.ns.dtype]
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
                self._loads[spec.req_id] = Load(spec, torch.empty(0), 0.0)
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
            load = Load(spec, staging, self._clock() + self._timeout(spec), after=handed_over)
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
