"""``KVCloudConnector``: vLLM's ``KVConnectorBase_V1`` over kvcloud.

vLLM builds the connector twice: in the scheduler process (role SCHEDULER: decides, no
tensors) and in each worker process (role WORKER: moves bytes). This class only routes each
call to the side that owns it (scheduler.py, worker.py); the KV layout lives in layout.py
and the namespace in keys.py.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ... import __version__
from ...client import KVCloud
from ...errors import ConfigError, KVCloudError
from ...namespace import Namespace
from .config import VLLMConnectorConfig
from .drafters import drafter_cuts_last_block
from .keys import check_supported, group_windows, vllm_namespace
from .metadata import (
    GAUGES,
    KVCloudConnectorMetadata,
    KVCloudConnectorStats,
    KVCloudPromMetrics,
)
from .scheduler import SchedulerSide
from .shard import Shard, shard_of
from .specs import KVCloudWorkerMeta, StepSpec, whole_failures
from .startup import check_at_start, identity
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.kvcloud")

# kvcloud client counters forwarded to vLLM's metrics under their own names
_CLIENT_COUNTERS = ("missing_objects", "verify_failures", "store_errors", "damaged_deleted")


def _tp_rank(tp: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if tp == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_stage(parallel_config: Any, num_layers: int) -> tuple[int, tuple[int, ...]]:
    """This worker's pipeline stage and every stage's first layer (then the end), as vLLM
    splits the layers (``get_pp_indices``, ``VLLM_PP_LAYER_PARTITION`` included)."""
    pp = int(parallel_config.pipeline_parallel_size)
    if pp == 1:
        return 0, (0, num_layers)
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    bounds = [get_pp_indices(num_layers, r, pp)[0] for r in range(pp)]
    return int(get_pp_group().rank_in_group), (*bounds, num_layers)


def _shard(vllm_config: Any, ns: Namespace, head_parts: int = 1) -> Shard:
    """The KV heads and layers this worker holds, and the head ranges it stores them in."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    stage, stages = _pp_stage(pc, ns.num_layers)
    return _stored_in(
        shard_of(_tp_rank(tp), tp, ns.num_kv_heads).with_stage(stage, stages), ns, head_parts
    )


def _shard_of_rank0(vllm_config: Any, ns: Namespace, head_parts: int) -> Shard:
    """What ``_shard`` checks, without the distributed state the scheduler does not have."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return _stored_in(shard_of(0, tp, ns.num_kv_heads), ns, head_parts)


def _stored_in(shard: Shard, ns: Namespace, head_parts: int) -> Shard:
    """``shard`` storing its chunks in ``head_parts`` head ranges; a ConfigError (one line
    at start) for a value that cannot split the model's heads."""
    try:
        return shard.with_head_parts(head_parts, ns.num_kv_heads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _route_kvcloud_logs() -> None:
    """kvcloud's own loggers (client, stores, indexes) write through vLLM's handlers, so a
    dropped entry or a failed verification shows up in vLLM's log like vLLM's own lines."""
    ours, theirs = logging.getLogger("kvcloud"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        # KVCLOUD_LOG_LEVEL=DEBUG shows each restore's pull time, for profiling
        ours.setLevel(os.environ.get("KVCLOUD_LOG_LEVEL", "INFO").upper())
        ours.propagate = False


class KVCloudConnectorError(KVCloudError, RuntimeError):
    """The connector cannot start (bad settings, unsupported model or cache)."""


class KVCloudConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares vLLM's prompt KV across processes and machines through kvcloud.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache allocator on with this connector, so a
    model with sliding-window layers beside full ones (Gemma 2/3, gpt-oss, Llama-style
    ``layer_types``) has a KV cache group per kind of layer, and a sliding group's blocks
    behind the window go back to the pool. Every chunk object still holds every layer: a
    chunk is saved only while every group holds all of it, and a restore writes each group's
    blocks (a sliding group's inside its window only); vLLM hears of a failed restore of such
    a model as the whole request failed, never as a partial one."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._client_seen: Counter[str] = Counter()
        _route_kvcloud_logs()
        from .versions import check_vllm_version  # a warning outside the tested vLLMs

        check_vllm_version()
        try:
            cfg = VLLMConnectorConfig.load(self._kv_transfer_config.kv_connector_extra_config)
            block_size = int(vllm_config.cache_config.block_size)
            if cfg.chunk_tokens % block_size:
                raise KVCloudConnectorError(
                    f"chunk_tokens {cfg.chunk_tokens} is not a multiple of vLLM's block size "
                    f"{block_size}: set kv_connector_extra_config.chunk_tokens (or "
                    "KVCLOUD_CHUNK_TOKENS) to a multiple of --block-size"
                )
            check_supported(vllm_config, kv_cache_config)
            ns = vllm_namespace(vllm_config, cfg, kv_cache_config)
            # rank 0's shard on the scheduler (it holds no KV): the same check at start
            shard = (
                _shard(vllm_config, ns, cfg.head_parts)
                if role != KVConnectorRole.SCHEDULER
                else _shard_of_rank0(vllm_config, ns, cfg.head_parts)
            )
            client_cfg = cfg.client_config()
            if role == KVConnectorRole.SCHEDULER:  # once per engine, not per worker
                check_at_start(cfg, client_cfg)
            client = KVCloud.open(config=client_cfg)
            # uploads get a client of their own (connections, threads): never in a load's way
            upload_client = (
                KVCloud.open(config=cfg.client_config())
                if role != KVConnectorRole.SCHEDULER and cfg.write_policy != "off"
                else None
            )
        except KVCloudError as exc:
            # one line that says what to change; vLLM then stops the engine
            msg = f"kvcloud connector cannot start: {exc}"
            log.error(msg)
            raise KVCloudConnectorError(msg) from None
        self.ns = ns
        self.client = client
        windows = group_windows(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            if int(getattr(vllm_config, "shutdown_timeout", 0) or 0) == 0:
                # vLLM's API server with --shutdown-timeout 0 (its default) kills the engine
                # and its workers the moment it is stopped: the uploads still queued are lost
                log.warning(
                    "kvcloud: --shutdown-timeout is 0, so when served by vLLM's API server a "
                    "stop kills the workers at once and the chunks still queued for upload "
                    "are lost; set --shutdown-timeout 15 (docs/VLLM.md, Stopping)"
                )
            # a failed kvcloud load is a miss: vLLM must recompute, not fail the request
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(
                cfg,
                ns,
                client,
                block_size,
                windows=windows,
                drafter=drafter_cuts_last_block(vllm_config),
            )
        else:
            self._worker = WorkerSide(
                cfg,
                ns,
                client,
                vllm_config,
                kv_cache_config,
                upload_client=upload_client,
                shard=shard,
            )
        who = identity(cfg, client_cfg)
        log.info(
            "kvcloud %s connector (%s): store %s, index %s, key id %s (tenant %s), "
            "namespace %s (%s, %d layers, %d KV heads × %d, %s, chunk %d tokens), "
            "writes %s, loads %s%s",
            __version__,
            role.name.lower(),
            client.store.url,
            client.index.url,
            who["key_id"],
            cfg.tenant,
            ns.id,
            ns.model,
            ns.num_layers,
            ns.num_kv_heads,
            ns.head_dim,
            ns.dtype,
            ns.chunk_tokens,
            cfg.write_policy,
            cfg.load_mode,
            ", backends probed (KVCLOUD_REQUIRE)"
            if cfg.require and role == KVConnectorRole.SCHEDULER
            else "",
        )
        if whole_failures(windows):
            log.info(
                "kvcloud connector: %d KV cache groups (%s), vLLM's hybrid allocator on: "
                "a chunk is stored whole in every group, a sliding group restored inside its "
                "window, restores run beside the pass",
                len(windows),
                ", ".join("full" if w is None else f"sliding {w}" for w in windows),
            )

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception as exc:  # any surprise in vLLM's caches: stop at start, say why
            msg = f"kvcloud connector cannot start: {exc}"
            log.error(msg)
            raise KVCloudConnectorError(msg) from None

    # Nothing raised in these calls may reach vLLM: an exception in the engine core stops
    # the engine for every request. Each guard logs, counts (``connector_errors``) and
    # falls back: a load that cannot start is reported failed (its blocks recomputed), a
    # save that cannot be made is a future miss, a lookup that fails is a miss.

    def _failed(self, where: str, exc: BaseException) -> None:
        log.warning("kvcloud: %s failed: %s: %s", where, type(exc).__name__, exc)
        side = self._worker or self._scheduler
        if side is not None:
            side.count(connector_errors=1)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # both model runners bind the step's metadata before its forward pass (start_load_kv
        # comes after the pass where the step has no restore in it): the pass is timed
        # from here to wait_for_save, for the cost guard's prefill rate
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVCloudConnectorMetadata):
            try:
                self._worker.pass_begins(connector_metadata)
            except Exception as exc:
                self._failed("timing this step", exc)

    def finish_forward(self) -> None:
        # vLLM's V2 runner: the pass's kernels are queued (its start_load_kv and
        # wait_for_save come after sampling and the drafter): the pass is timed to here
        if self._worker is not None:
            self._worker.pass_ends()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVCloudConnectorMetadata):
            try:
                self._worker.start_load_kv(meta)
            except Exception as exc:
                self._failed("starting this step's restores", exc)
                try:
                    self._worker.fail_loads(meta)
                except Exception as again:
                    self._failed("reporting this step's restores failed", again)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            try:
                self._worker.wait_for_layer_load(layer_name)
            except Exception as exc:
                self._failed(f"waiting for {layer_name}", exc)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVCloudConnectorMetadata):
            try:
                self._worker.save_kv_layer(meta, layer_name, kv_layer)
            except Exception as exc:
                self._failed(f"saving {layer_name}", exc)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            try:
                self._worker.wait_for_save()
            except Exception as exc:
                self._failed("handing this step's saves over", exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        try:
            return self._worker.get_finished(finished_req_ids)
        except Exception as exc:  # a bug here must not kill the engine; loads stay pending
            self._failed("checking finished restores", exc)
            return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # several KV cache groups or a sliding one (specs.whole_failures): a failed restore
        # is reported as its request failed, and vLLM recomputes it whole
        sending, recving = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        if self._worker is not None:
            try:
                failed = self._worker.take_failed_requests()
            except Exception as exc:
                self._failed("reporting failed restores", exc)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        try:
            return self._worker.get_block_ids_with_load_errors()
        except Exception as exc:
            self._failed("reporting failed restores", exc)
            return set()

    def build_connector_worker_meta(self) -> KVCloudWorkerMeta | None:
        if self._worker is None:
            return None
        try:
            return self._worker.build_worker_meta()
        except Exception as exc:  # a report not sent: the scheduler offers as before
            self._failed("reporting to the scheduler", exc)
            return None

    def get_kv_connector_stats(self) -> KVCloudConnectorStats | None:
        side = self._worker or self._scheduler
        if side is None:
            return None
        data = Counter(side.take_stats())
        totals = self.client.stats()
        for name in _CLIENT_COUNTERS:
            delta = totals.get(name, 0) - self._client_seen[name]
            if delta:
                data[name] += delta
                self._client_seen[name] = totals.get(name, 0)
        data = {k: v for k, v in data.items() if v or k in GAUGES}
        if not data:
            return None
        return KVCloudConnectorStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        else:
            if self._scheduler is not None:
                self._scheduler.shutdown()
            try:
                self.client.close()
            except KVCloudError as exc:
                log.warning("kvcloud: closing the client: %s", exc)

    # -- scheduler side ---------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.on_new_request(request)
            except Exception as exc:  # the lookup is retried when vLLM asks for the hit
                self._failed(f"starting the lookup of {request.request_id}", exc)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # a lookup problem is a miss, never a failed request
            self._failed(f"the lookup of {request.request_id}", exc)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._scheduler is not None
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:
            # vLLM now expects these blocks filled: fill nothing, and have the worker
            # report them failed so they are recomputed (never left unwritten)
            self._failed(f"planning the restore of {request.request_id}", exc)
            try:
                self._scheduler.load_unplanned(request, blocks, num_external_tokens)
            except Exception as again:  # vLLM's blocks cannot even be read: nothing to do
                self._failed(f"refusing the restore of {request.request_id}", again)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.update_connector_output(connector_output)
            except Exception as exc:
                self._failed("reading the workers' report", exc)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        try:
            step = self._scheduler.build_connector_meta(scheduler_output)
        except Exception as exc:
            # this step's saves are lost (future misses); its loads still go out, as
            # failed ones, so no request waits for a restore that never runs
            self._failed("building this step's metadata", exc)
            try:
                step = self._scheduler.failed_step()
            except Exception as again:
                self._failed("refusing this step's restores", again)
                step = StepSpec()
        step.tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        return KVCloudConnectorMetadata(loads=step.loads, saves=step.saves, tokens=step.tokens)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            try:
                self._scheduler.request_finished(request)
            except Exception as exc:
                self._failed(f"forgetting {request.request_id}", exc)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # (SupportsHMA) saves are copied in the step that computes them: nothing to hold
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @property
    def requires_kv_delivery(self) -> bool:
        # a lost push is a future miss, nothing more
        return False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVCloudConnectorStats | None:
        return KVCloudConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVCloudPromMetrics:
        return KVCloudPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- sleep mode -------------------------------------------------------------------------
    # vLLM 0.33's connector base asks ``supports_sleep_mode`` and, for a connector that says
    # yes, calls ``release_kv_caches`` (``unregister_kv_caches`` in some builds) before its
    # sleep-mode allocator unmaps the KV cache and ``restore_kv_caches`` once it is mapped
    # again. 0.32's base has none of these: defined here, they are simply never called there.
    # The connector refuses sleep mode (versions.SLEEP_MODE_REASON): ``check_supported``
    # stops an engine started with --enable-sleep-mode, so vLLM never gets this far.

    @classmethod
    def supports_sleep_mode(cls, vllm_config: Any = None) -> bool:
        return False

    def release_kv_caches(self) -> None:
        # reached only by a vLLM that ignored supports_sleep_mode: stop its sleep here, before
        # the unmap, rather than let a load thread write into freed memory
        from .versions import SLEEP_MODE_REASON

        log.error("kvcloud: %s", SLEEP_MODE_REASON)
        raise KVCloudConnectorError(SLEEP_MODE_REASON)

    def unregister_kv_caches(self) -> None:
        self.release_kv_caches()

    def restore_kv_caches(self) -> None:
        # nothing was released (release_kv_caches refuses), so nothing to learn again
        return None
