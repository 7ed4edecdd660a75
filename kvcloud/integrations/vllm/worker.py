"""Worker side: move KV between kvcloud objects and vLLM's paged blocks.

Loads: ``start_load_kv`` starts pulling every matched object (in parallel, verified as they
land) into a staging array in kvcloud's layout; each attention layer's
``wait_for_layer_load`` waits for the pulls (bounded by ``load_timeout``) and scatters only
that layer into the request's blocks, so the forward pass runs while later layers are still
to be written. A chunk that is missing, corrupt, late or unreachable — and every chunk after
it — becomes a set of block ids reported through ``get_block_ids_with_load_errors``; vLLM
then recomputes exactly those tokens. Nothing here raises into vLLM.

Saves: ``save_kv_layer`` copies each layer's slice of the chunks the step completed into a
staging array right after the layer ran; ``wait_for_save`` hands whole chunks to a bounded
background uploader (the kvcloud worker's policy: when the queue is full a chunk is dropped
and counted, never waited for), which pushes them object first, entry second.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ...client import ChunkRef, KVCloud, Match
from ...errors import ConfigError, KVCloudError, LayoutError
from ...indexes.base import IndexEntry
from ...namespace import Namespace
from .._torch import to_numpy
from .config import VLLMConnectorConfig
from .layout import BlockLayout, learn_layout
from .metadata import KVCloudConnectorMetadata, LoadSpec, SaveSpec
from .uploader import Uploader

log = logging.getLogger("vllm.kvcloud")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class _Load:
    spec: LoadSpec
    staging: torch.Tensor  # [layers, 2, chunks·chunk_tokens, heads, dim]
    future: cf.Future | None
    deadline: float
    ok_chunks: int = -1  # known once the pull finished (or timed out)
    layers_done: set[int] = field(default_factory=set)


@dataclass
class _Save:
    spec: SaveSpec
    staging: list[torch.Tensor]  # one [layers, 2, chunk_tokens, heads, dim] per chunk
    layers_done: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(
        self,
        cfg: VLLMConnectorConfig,
        ns: Namespace,
        client: KVCloud,
        vllm_config: Any,
        kv_cache_config: Any,
    ) -> None:
        self.cfg = cfg
        self.ns = ns
        self.client = client
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self.uploader = (
            Uploader(client, ns, cfg.upload_queue, self.count)
            if cfg.write_policy != "off"
            else None
        )
        self._pool = cf.ThreadPoolExecutor(2, thread_name_prefix="kvcloud-load")
        self.caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.layouts: dict[str, BlockLayout] = {}
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._failed_blocks: set[int] = set()

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            self.stats.update(deltas)

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.ns.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV cache layers; the model config says "
                f"{self.ns.num_layers}"
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
                    self.ns.num_kv_heads,
                    self.ns.head_dim,
                )
            self.caches[name] = cache
            self.layer_index[name] = i
            self.layouts[name] = layout
        first = self.layouts[names[0]]
        log.info(
            "kvcloud: learned vLLM's KV layout: cache %s %s, block axis %d, %s block interior",
            list(kv_caches[names[0]].shape),
            str(want).removeprefix("torch."),
            first.block_dim,
            "natural" if first.natural else "permuted",
        )

    # -- loads ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVCloudConnectorMetadata) -> None:
        for spec in meta.loads:
            if not spec.chunks:
                continue
            c = self.ns.chunk_tokens
            staging = torch.empty(
                self.ns.kv_shape(len(spec.chunks) * c), dtype=_TORCH_DTYPES[self.ns.dtype]
            )
            deadline = time.monotonic() + self.cfg.load_timeout
            future = self._pool.submit(self._pull, spec, staging)
            self._loads.append(_Load(spec, staging, future, deadline))

    def _pull(self, spec: LoadSpec, staging: torch.Tensor) -> int:
        c = self.ns.chunk_tokens
        refs = tuple(
            ChunkRef(ch.position, ch.fp, ch.parent, IndexEntry(ch.object_key, c, ch.size, 0.0))
            for ch in spec.chunks
        )
        m = Match(self.ns, spec.tenant, refs, refs[-1].position + 1)
        arr = to_numpy(staging)
        dests = [arr[:, :, i * c : (i + 1) * c] for i in range(len(refs))]
        res = self.client.pull_into(m, dests)
        self.count(loaded_bytes=res.bytes)
        return res.chunks

    def _settle(self, load: _Load) -> None:
        """Wait (until the deadline) for a load's pulls; record what failed."""
        if load.ok_chunks >= 0:
            return
        assert load.future is not None
        try:
            load.ok_chunks = load.future.result(max(0.0, load.deadline - time.monotonic()))
        except cf.TimeoutError:
            log.warning(
                "kvcloud restore of %s ran past load_timeout (%.1fs): recomputing",
                load.spec.req_id,
                self.cfg.load_timeout,
            )
            self.count(load_timeouts=1)
            load.ok_chunks = 0
        except Exception as exc:
            log.warning("kvcloud restore of %s failed: %s: recomputing", load.spec.req_id, exc)
            load.ok_chunks = 0
        for ch in load.spec.chunks[load.ok_chunks :]:
            self._failed_blocks.update(b for b in ch.block_ids if b >= 0)
        failed = sum(1 for ch in load.spec.chunks[load.ok_chunks :] for b in ch.block_ids if b >= 0)
        loaded = sum(1 for ch in load.spec.chunks[: load.ok_chunks] for b in ch.block_ids if b >= 0)
        self.count(load_failed_blocks=failed, loaded_tokens=loaded * self.block_size)

    def _inject(self, load: _Load, name: str) -> None:
        layer = self.layer_index[name]
        if layer in load.layers_done:
            return
        self._settle(load)
        load.layers_done.add(layer)
        c, bs = self.ns.chunk_tokens, self.block_size
        cache, layout = self.caches[name], self.layouts[name]
        ids: list[int] = []
        rows: list[int] = []
        for i, ch in enumerate(load.spec.chunks[: load.ok_chunks]):
            for k, b in enumerate(ch.block_ids):
                if b >= 0:
                    ids.append(b)
                    rows.append(i * c + k * bs)
        if not ids:
            return
        kv = load.staging[layer]  # [2, T, H, D]
        if rows == list(range(rows[0], rows[0] + len(rows) * bs, bs)):
            src = kv[:, rows[0] : rows[0] + len(rows) * bs]
        else:
            src = torch.cat([kv[:, r : r + bs] for r in rows], dim=1)
        layout.scatter(cache, ids, src)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name not in self.layer_index:
            return
        for load in self._loads:
            try:
                self._inject(load, layer_name)
            except Exception as exc:  # never into vLLM: the blocks are recomputed instead
                log.warning("kvcloud: could not write %s into vLLM's cache: %s", layer_name, exc)
                self._fail(load)

    def _fail(self, load: _Load) -> None:
        load.ok_chunks = 0
        for ch in load.spec.chunks:
            self._failed_blocks.update(b for b in ch.block_ids if b >= 0)

    def _finish_loads(self) -> None:
        """After the forward pass: a load whose layers were not all written is a failure."""
        for load in self._loads:
            if load.ok_chunks < 0:
                self._settle(load)
            if load.ok_chunks > 0 and len(load.layers_done) < self.ns.num_layers:
                log.warning(
                    "kvcloud: only %d of %d layers of %s were written; recomputing",
                    len(load.layers_done),
                    self.ns.num_layers,
                    load.spec.req_id,
                )
                self._fail(load)
        self._loads = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves ------------------------------------------------------------------------------

    def save_kv_layer(
        self, meta: KVCloudConnectorMetadata, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
        if self.uploader is None or not meta.saves or layer_name not in self.layer_index:
            return
        if not self._saves:
            dtype = _TORCH_DTYPES[self.ns.dtype]
            shape = self.ns.kv_shape(self.ns.chunk_tokens)
            self._saves = [
                _Save(spec, [torch.empty(shape, dtype=dtype) for _ in spec.chunks])
                for spec in meta.saves
            ]
        layer = self.layer_index[layer_name]
        layout = self.layouts[layer_name]
        for save in self._saves:
            try:
                for ch, staging in zip(save.spec.chunks, save.staging, strict=True):
                    staging[layer].copy_(layout.gather(kv_layer, ch.block_ids))
                save.layers_done.add(layer)
            except (LayoutError, RuntimeError, IndexError) as exc:
                log.warning("kvcloud: could not read %s for saving: %s", layer_name, exc)

    def wait_for_save(self) -> None:
        self._finish_loads()
        saves, self._saves = self._saves, []
        if self.uploader is None:
            return
        for save in saves:
            if len(save.layers_done) != self.ns.num_layers:
                continue
            for ch, staging in zip(save.spec.chunks, save.staging, strict=True):
                self.uploader.offer(save.spec.tenant, ch.fp, ch.parent, to_numpy(staging))

    # -- stats and shutdown -----------------------------------------------------------------

    def take_stats(self) -> dict[str, int]:
        with self._stats_lock:
            out = dict(self.stats)
            self.stats.clear()
        return out

    def shutdown(self) -> None:
        if self.uploader is not None:
            self.uploader.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except KVCloudError as exc:
            log.warning("kvcloud: closing the client: %s", exc)
