"""The connector's background uploader: bounded, never blocks a forward pass.

The kvcloud worker's policy: chunks wait in a bounded queue; when it is full a new chunk is
dropped and counted (a future miss), never waited for; a failed push is counted and logged,
never raised. Pushes go object first, index entry second (``KVCloud.push_chunks``), batched
per tenant, skipping chunks already indexed. numpy only, so it is tested without vLLM.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import numpy as np

from ...client import KVCloud
from ...errors import PushError
from ...namespace import Namespace

log = logging.getLogger("vllm.kvcloud")

_BATCH = 16

# tenant, fingerprint, parent, KV, what to call once the KV is no longer needed, and what
# to wait on before reading the KV (a device's copy into it may still be in flight)
_Item = tuple[str, bytes, bytes, np.ndarray, Callable[[], None] | None, Callable[[], None] | None]


def lower_priority(nice: int) -> None:
    """Run the calling thread, and the threads it starts from now on (the upload client's
    transfer pool is started lazily by the first push), at ``nice``: on a core the forward
    pass keeps busy, the kernel then gives a save's hashing, encryption and writing the idle
    time rather than a slice of a step. Linux keeps a nice value per thread; elsewhere, or
    without permission, the uploader runs at its process's priority (logged)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError) as exc:
        log.info("kvcloud uploader: could not lower its priority to nice %d: %s", nice, exc)


class Uploader:
    """Bounded background pushes; a full queue drops, a failed push is counted."""

    def __init__(
        self,
        client: KVCloud,
        ns: Namespace,
        capacity: int,
        count: Callable[..., None],
        nice: int = 0,
        *,
        part: tuple[int, int] | None = None,
        parts: int = 1,
        layers: tuple[int, int] | None = None,
        stages: tuple[int, ...] | None = None,
    ):
        self.client = client
        self.ns = ns
        self.count = count
        self.nice = nice
        # a tensor-parallel rank stores the KV heads it holds as one of a chunk's ``parts``;
        # the writer of the last part to be stored registers the chunk (KVCloud.offer_part)
        self.part = part
        self.parts = parts
        # a pipeline stage stores its layers likewise, one row of the chunk's grid of parts
        self.layers = layers
        self.stages = stages
        self._queue: queue.Queue[_Item | None] = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._run, name="kvcloud-uploader", daemon=True)
        self._thread.start()

    def offer(
        self,
        tenant: str,
        fp: bytes,
        parent: bytes,
        kv: np.ndarray,
        done: Callable[[], None] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> bool:
        """Queue one chunk; False (and counted) when the queue is full. ``done`` is called
        once the chunk's KV has been pushed or given up on (never when refused here);
        ``ready`` is waited on, on the uploader's thread, before the KV is read."""
        try:
            self._queue.put_nowait((tenant, fp, parent, kv, done, ready))
        except queue.Full:
            self.count(upload_dropped=1)
            return False
        self.count(chunks_queued=1)
        return True

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._push(batch)
                    return
                batch.append(nxt)
            self._push(batch)

    def _push(self, batch: list[_Item]) -> None:
        try:
            self._push_batch(batch)
        finally:
            for *_, done, _ready in batch:
                if done is not None:
                    done()

    def _push_batch(self, batch: list[_Item]) -> None:
        if self.part is not None or self.layers is not None:
            self._store_parts(batch)
            return
        by_tenant: dict[str, list[tuple[bytes, bytes, np.ndarray]]] = {}
        for tenant, fp, parent, kv, _, ready in batch:
            if ready is not None:
                ready()
            by_tenant.setdefault(tenant, []).append((fp, parent, kv))
        for tenant, chunks in by_tenant.items():
            try:
                res = self.client.push_chunks(self.ns, chunks, tenant=tenant)
            except PushError as exc:
                res = exc.result
                log.warning("kvcloud push failed for %d chunks: %s", res.failed, exc)
            except Exception as exc:  # the uploader must outlive any backend failure
                log.warning("kvcloud push failed: %s", exc)
                self.count(push_failures=len(chunks))
                continue
            self.count(
                chunks_pushed=res.pushed,
                chunks_already_stored=res.already_indexed,
                push_failures=res.failed,
            )

    def _store_parts(self, batch: list[_Item]) -> None:
        for tenant, fp, parent, kv, _, ready in batch:
            if ready is not None:
                ready()
            try:
                key, size = self.client.store_part(
                    self.ns, fp, parent, kv, self.part, layers=self.layers, tenant=tenant
                )
                self.count(parts_pushed=1)
                n = int(kv.shape[2])
                if self.client.offer_part(
                    self.ns, fp, self.part, key, size, n, self.parts,
                    layers=self.layers, stages=self.stages,
                ):  # fmt: skip
                    self.count(chunks_registered=1)
            except Exception as exc:  # the uploader must outlive any backend failure
                log.warning("kvcloud part push failed: %s", exc)
                self.count(push_failures=1)

    def close(self, timeout: float = 30.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("kvcloud uploader: queue still full at shutdown; pending chunks lost")
            return
        self._thread.join(timeout)
