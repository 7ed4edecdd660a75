"""Run vLLM's ``OffloadingConnector`` + ``TieringOffloadingSpec`` on the CPU backend.

What this replaces: only the worker that copies KV blocks between vLLM's KV cache
tensors and the host (CPU) tier, ``CPUOffloadingWorker`` in
``vllm/v1/kv_offload/cpu/gpu_worker.py``. vLLM refuses to build that worker off a GPU:
``CPUOffloadingSpec.get_worker`` (``vllm/v1/kv_offload/cpu/spec.py``) raises "CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs", and the worker itself
asserts CUDA/XPU tensors and issues its copies on device streams with events
(``swap_blocks_batch``), none of which exist on the CPU backend, where the KV cache
already lives in host memory.

What stays as vLLM ships it: everything else, i.e. the connector, ``TieringOffloadingSpec``
and its ``TieringOffloadingManager`` (scheduler side), the host tier
(``CPUPrimaryTierOffloadingManager`` over the shared ``/dev/shm`` region), the secondary
tiers (``fs``: one file per block hash, tmp+rename writes, lookup by file existence),
lookup, promotion and eviction. :class:`CPUTieringOffloadingSpec` subclasses
``TieringOffloadingSpec`` and overrides only ``get_worker``/``create_worker`` to return
:class:`SyncCPUOffloadingWorker`, which maps the same host region the manager sees and
copies blocks with ``index_select``/``index_copy_`` when a transfer is submitted, so
every job is finished by the time ``get_finished`` is called.

One addition outside the worker: once vLLM's scheduler side has mapped the host region
(``get_manager``, which the engine calls after every worker registered its KV caches and
mapped the region), the spec unlinks ``/dev/shm/vllm_offload_<engine_id>.mmap``. vLLM's
CPU-only spec does the same after a barrier; the tiering spec does not, and on this
backend vLLM force-kills EngineCore and its worker at shutdown (no connector shutdown
runs), which left one ``cpu_bytes_to_use``-sized file in ``/dev/shm`` per server run. The
mappings stay valid; the kernel frees the memory when the last process exits.

Limits: one block per offloaded chunk (``blocks_per_chunk == 1``, the default when
``block_size`` is not set in the extra config) and the direct (non-canonical) layout.

Use it by module path in ``kv_connector_extra_config``::

    {"spec_name": "CPUTieringOffloadingSpec",
     "spec_module_path": "scripts.checks.vllm_offload_cpu", ...}
"""

from __future__ import annotations

import os
import time

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class _SyncDirection:
    """Copies blocks one way (device cache -> host tier, or back), synchronously."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor], refs_per_group):
        self.src, self.dst, self.refs_per_group = src, dst, refs_per_group
        self.done: list[TransferResult] = []

    def transfer(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        device_spec = src_spec if isinstance(src_spec, GPULoadStoreSpec) else dst_spec
        assert isinstance(device_spec, GPULoadStoreSpec)
        assert len(device_spec.group_sizes) == len(self.refs_per_group)
        src_ids = torch.from_numpy(src_spec.block_ids).long()
        dst_ids = torch.from_numpy(dst_spec.block_ids).long()
        assert len(src_ids) == len(dst_ids) == sum(device_spec.group_sizes)
        t0 = time.perf_counter()
        nbytes = start = 0
        for size, refs in zip(device_spec.group_sizes, self.refs_per_group, strict=True):
            if size:
                s, d = src_ids[start : start + size], dst_ids[start : start + size]
                for ref in refs:
                    width = ref.page_size_bytes  # un-padded bytes of this layer's page
                    rows = self.src[ref.tensor_idx][:, :width].index_select(0, s)
                    self.dst[ref.tensor_idx][:, :width].index_copy_(0, d, rows)
                    nbytes += size * width
            start += size
        self.done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True


class SyncCPUOffloadingWorker(OffloadingWorker):
    """``OffloadingWorker`` for KV caches already in host memory (vLLM's CPU backend).

    Same interface as vLLM's ``CPUOffloadingWorker`` (``submit_store``,
    ``submit_load``, ``get_finished``, ``wait``, ``shutdown``) and the same host
    layout (one strided int8 view per KV tensor into the shared offload region), but
    each submit copies at once on the calling thread, so ``wait`` has nothing to do.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion):
        self._region: SharedOffloadRegion | None = region
        cache_views: list[torch.Tensor] = []
        host_views: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            view = t.tensor.view(torch.int8)
            assert view.device.type == "cpu" and view.ndim == 2
            assert view.shape[1] == t.page_size_bytes
            cache_views.append(view)
            host_views.append(region.create_next_worker_view(t.page_size_bytes))
        refs = kv_caches.group_data_refs
        self._store = _SyncDirection(cache_views, host_views, refs)
        self._load = _SyncDirection(host_views, cache_views, refs)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._store.transfer(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._load.transfer(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        out = self._store.done + self._load.done
        self._store.done, self._load.done = [], []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job has already been copied

    def shutdown(self) -> None:
        for d in (self._store, self._load):
            d.src, d.dst, d.done = [], [], []
        if self._region is not None:
            if not os.path.exists(self._region.mmap_path):
                self._region._creator = False  # unlinked by the spec's get_manager
            self._region.cleanup()
            self._region = None


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker is :class:`SyncCPUOffloadingWorker`."""

    def __init__(self, config):
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError("CPUTieringOffloadingSpec supports blocks_per_chunk == 1 only")
        if self.config.canonical_layout:
            raise ValueError("CPUTieringOffloadingSpec does not support canonical_layout")
        self._sync_worker: SyncCPUOffloadingWorker | None = None

    def create_worker(self, kv_caches: CanonicalKVCaches) -> SyncCPUOffloadingWorker:
        # the same region (engine id, rank slot, sizes) the tiering spec's own worker maps
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return SyncCPUOffloadingWorker(kv_caches, region)
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._sync_worker is None:
            self._sync_worker = self.create_worker(kv_caches)
        return self._sync_worker

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        region = self._scheduler_mmap
        # joined the file the worker created: every mapping exists, so drop its name
        if region is not None and not region._creator and os.path.exists(region.mmap_path):
            os.unlink(region.mmap_path)
        return manager
