"""Worker side: move KV between kvcloud objects and vLLM's paged blocks.

Loads: ``start_load_kv`` starts pulling every matched object in parallel, each streamed
straight into its own slice of a staging array in kvcloud's layout and hashed as it lands;
each attention layer's ``wait_for_layer_load`` waits for the pulls (bounded by
``load_timeout``) and writes only that layer of the verified chunks into the request's blocks,
so the forward pass runs while later layers are still to be written. No byte of a chunk
reaches vLLM's cache before the chunk is verified (DESIGN §4.3). A chunk that is missing,
corrupt, late or unreachable — and every chunk after it — becomes a set of block ids reported
through ``get_block_ids_with_load_errors``; vLLM then recomputes exactly those tokens.
Nothing here raises into vLLM.

Saves: ``save_kv_layer`` copies each layer's slice of the chunks the step completed into a
staging array right after the layer ran; ``wait_for_save`` hands whole chunks to a bounded
background uploader (the kvcloud worker's policy: when the queue is full a chunk is dropped
and counted, never waited for), which pushes them object first, entry second.
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
from .layout import BlockLayout, learn_layout
from .specs import LoadSpec, SaveSpec
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
    future: cf.Future[int]
    deadline: float
    ok_chunks: int = -1  # verified chunks (a prefix), known once the pull is over
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
        self._kept: torch.Tensor | None = None  # staging reused across restores
        self._kept_users: list[cf.Future[int]] = []
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
        specs = [spec for spec in meta.loads if spec.chunks]
        if not specs:
            return
        buf = self._staging(sum(len(spec.chunks) for spec in specs))
        first = 0
        for spec in specs:
            # one contiguous [layers, 2, chunk_tokens, heads, dim] per chunk, so each
            # object streams straight in and is hashed as it lands
            staging = buf[first : first + len(spec.chunks)]
            first += len(spec.chunks)
            future = self._pool.submit(self._pull, spec, staging)
            if self._kept is not None and buf.data_ptr() == self._kept.data_ptr():
                self._kept_users.append(future)
            deadline = time.monotonic() + self.cfg.load_timeout
            self._loads.append(_Load(spec, staging, future, deadline))

    def _staging(self, n_chunks: int) -> torch.Tensor:
        """Room for ``n_chunks`` pulled chunks: the kept buffer when it is free and big
        enough (a timed-out pull may still be writing into it), else fresh memory."""
        shape = (n_chunks, *self.ns.kv_shape(self.ns.chunk_tokens))
        dtype = _TORCH_DTYPES[self.ns.dtype]
        free = all(f.done() for f in self._kept_users)
        if free:
            self._kept_users = []
            kept = self._kept
            if kept is not None and kept.shape[0] >= n_chunks:
                return kept[:n_chunks]
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes <= self.cfg.staging_mib << 20:
                self._kept = torch.empty(shape, dtype=dtype)
                return self._kept
        return torch.empty(shape, dtype=dtype)

    def _pull(self, spec: LoadSpec, staging: torch.Tensor) -> int:
        c = self.ns.chunk_tokens
        refs = tuple(
            ChunkRef(ch.position, ch.fp, ch.parent, IndexEntry(ch.object_key, c, ch.size, 0.0))
            for ch in spec.chunks
        )
        m = Match(self.ns, spec.tenant, refs, refs[-1].position + 1)
        started = time.monotonic()
        res = self.client.pull_into(m, list(to_numpy(staging)))
        log.debug(
            "kvcloud: pulled %d of %d chunks (%d bytes) for %s in %.0f ms",
            res.chunks,
            len(refs),
            res.bytes,
            spec.req_id,
            1e3 * (time.monotonic() - started),
        )
        self.count(loaded_bytes=res.bytes)
        return res.chunks

    def _settle(self, load: _Load) -> None:
        """Wait (until the deadline) for a load's pulls; the verified chunks are a prefix."""
        if load.ok_chunks >= 0:
            return
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

    def _write_layer(self, load: _Load, name: str) -> None:
        layer = self.layer_index[name]
        if layer in load.layers_done:
            return
        self._settle(load)
        load.layers_done.add(layer)
        bs = self.block_size
        cache, layout = self.caches[name], self.layouts[name]
        for i, ch in enumerate(load.spec.chunks[: load.ok_chunks]):
            kv = load.staging[i, layer]  # [2, chunk_tokens, heads, dim]
            # blocks vLLM already holds are -1: write each run of the others in one go
            k = 0
            while k < len(ch.block_ids):
                if ch.block_ids[k] < 0:
                    k += 1
                    continue
                end = k
                while end < len(ch.block_ids) and ch.block_ids[end] >= 0:
                    end += 1
                layout.scatter(cache, ch.block_ids[k:end], kv[:, k * bs : end * bs])
                k = end

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name not in self.layer_index:
            return
        for load in self._loads:
            try:
                self._write_layer(load, layer_name)
            except Exception as exc:  # never into vLLM: the blocks are recomputed instead
                log.warning("kvcloud: could not write %s into vLLM's cache: %s", layer_name, exc)
                load.ok_chunks = 0

    def _finish_loads(self) -> None:
        """After the forward pass: report every chunk not verified and written in full."""
        for load in self._loads:
            self._settle(load)
            ok = load.ok_chunks
            if ok > 0 and len(load.layers_done) < self.ns.num_layers:
                log.warning(
                    "kvcloud: only %d of %d layers of %s were written; recomputing",
                    len(load.layers_done),
                    self.ns.num_layers,
                    load.spec.req_id,
                )
                ok = 0
            chunks = load.spec.chunks
            failed = [b for ch in chunks[ok:] for b in ch.block_ids if b >= 0]
            loaded = sum(1 for ch in chunks[:ok] for b in ch.block_ids if b >= 0)
            self._failed_blocks.update(failed)
            self.count(load_failed_blocks=len(failed), loaded_tokens=loaded * self.block_size)
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
