"""The connector's background uploader: bounded, never blocks a forward pass.

The kvcloud worker's policy: chunks wait in a bounded queue; when it is full a new chunk is
dropped and counted (a future miss), never waited for; a failed push is counted and logged,
never raised. Pushes go object first, index entry second (``KVCloud.push_chunks``), batched
per tenant, skipping chunks already indexed. numpy only, so it is tested without vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping

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
        ranges: list[tuple[int, int] | None] | None = None,
        layers: tuple[int, int] | None = None,
        stages: tuple[int, ...] | None = None,
        observe: Callable[[str, float], None] | None = None,
    ):
        self.client = client
        # histograms: save_lag_seconds, from a chunk handed over (the end of the step that
        # computed its last token) to its entry visible in the index (how stale a next turn
        # sent at once finds the store); upload_seconds, from a chunk taken off the queue
        # to stored and registered (a batch's chunks finish together)
        self.observe = observe
        self._offered_at: dict[bytes, float] = {}
        self._offered_lock = threading.Lock()
        self.ns = ns
        self.count = count
        self.nice = nice
        # a tensor-parallel rank stores the KV heads it holds as one of a chunk's ``parts``;
        # the writer of the last part to be stored registers the chunk (KVCloud.offer_part)
        self.part = part
        self.parts = parts
        # the head ranges of the parts this rank writes (absolute), each sliced from the
        # rank's own heads starting at ``part``'s first: more than one where the chunk is
        # stored finer than the TP split (``head_parts``)
        self.ranges = ranges if ranges is not None else [part]
        # a pipeline stage stores its layers likewise, one row of the chunk's grid of parts
        self.layers = layers
        self.stages = stages
        self._queue: queue.Queue[_Item | None] = queue.Queue(capacity)
        self._busy = 0  # chunks in the push under way (taken from the queue, not yet done)
        self._taken = 0.0  # when that push took them
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
        with self._offered_lock:
            self._offered_at[fp] = time.monotonic()
        try:
            self._queue.put_nowait((tenant, fp, parent, kv, done, ready))
        except queue.Full:
            with self._offered_lock:
                self._offered_at.pop(fp, None)
            self.count(upload_dropped=1)
            return False
        self.count(chunks_queued=1)
        return True

    def room(self) -> int:
        """Chunks the queue would take now: a save copies no more than this out of vLLM's
        blocks (a copy the full queue then drops is wasted work on a sick store)."""
        return max(0, self._queue.maxsize - self._queue.qsize())

    def depth(self) -> int:
        """Chunks queued or in the push under way (the upload_queue_depth gauge)."""
        return self._queue.qsize() + self._busy

    def _visible(self, fps: list[bytes], ok: bool) -> None:
        """These chunks' entries are in the index (``ok``), or given up on: their lag."""
        now = time.monotonic()
        with self._offered_lock:
            started = [self._offered_at.pop(fp, None) for fp in fps]
        if ok and self.observe is not None:
            for t in started:
                if t is not None:
                    self.observe("save_lag_seconds", now - t)
                    self.observe("upload_seconds", now - self._taken)

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
        self._busy = len(batch)
        self._taken = time.monotonic()
        try:
            self._push_batch(batch)
        finally:
            self._busy = 0
            for *_, done, _ready in batch:
                if done is not None:
                    done()

    def _push_batch(self, batch: list[_Item]) -> None:
        if self.ranges != [None] or self.layers is not None:
            self._store_parts(batch)
            return
        by_tenant: dict[str, list[tuple[bytes, bytes, np.ndarray]]] = {}
        for tenant, fp, parent, kv, _, ready in batch:
            if ready is not None:
                ready()
            by_tenant.setdefault(tenant, []).append((fp, parent, kv))
        for tenant, chunks in by_tenant.items():
            fps = [fp for fp, _, _ in chunks]
            try:
                res = self.client.push_chunks(self.ns, chunks, tenant=tenant)
            except PushError as exc:
                res = exc.result
                log.warning("kvcloud push failed for %d chunks: %s", res.failed, exc)
            except Exception as exc:  # the uploader must outlive any backend failure
                log.warning("kvcloud push failed: %s", exc)
                self.count(push_failures=len(chunks))
                self._visible(fps, ok=False)
                continue
            # (a batch with a failure is not timed: which chunks made it is not reported)
            self._visible(fps, ok=not res.failed)
            self.count(
                chunks_pushed=res.pushed,
                chunks_already_stored=res.already_indexed,
                push_failures=res.failed,
                pushed_bytes=res.bytes_written,
            )

    def _store_parts(self, batch: list[_Item]) -> None:
        first = self.part[0] if self.part is not None else 0
        for tenant, fp, parent, kv, _, ready in batch:
            if ready is not None:
                ready()
            n = int(kv.shape[2])
            try:
                registered = False
                for heads in self.ranges:
                    sub = kv if heads is None else kv[:, :, :, heads[0] - first : heads[1] - first]
                    key, size = self.client.store_part(
                        self.ns, fp, parent, sub, heads, layers=self.layers, tenant=tenant
                    )
                    self.count(parts_pushed=1, pushed_bytes=size)
                    registered |= self.client.offer_part(
                        self.ns, fp, heads, key, size, n, self.parts,
                        layers=self.layers, stages=self.stages,
                    )  # fmt: skip
                if registered:
                    self.count(chunks_registered=1)
                # the rank whose part lands last makes the chunk visible: it times the lag
                self._visible([fp], ok=registered)
            except Exception as exc:  # the uploader must outlive any backend failure
                log.warning("kvcloud part push failed: %s", exc)
                self.count(push_failures=1)
                self._visible([fp], ok=False)

    def close(self, timeout: float = 30.0) -> int:
        """Stop: push what is still queued for at most ``timeout`` seconds, then give up on
        the rest. Returns by the deadline whatever the store does (the thread is a daemon:
        a push hung past it dies with the process). What is left is counted
        (``upload_dropped_at_stop``), logged, and returned: chunks still queued, never
        pushed, and those of a push still under way, which may yet land if the process
        outlives the deadline (counted: nothing says they did)."""
        started = time.monotonic()
        deadline = started + max(0.0, timeout)
        pending = self._queue.qsize() + self._busy
        if pending:
            # logged first: should vLLM kill the process before the deadline, this line
            # says what was lost with it
            log.info(
                "kvcloud uploader: stopping with %d chunks not yet stored; pushing them for "
                "at most %.1f s",
                pending,
                timeout,
            )
        with contextlib.suppress(queue.Full):  # still full at the deadline: given up below
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            if pending:
                log.info(
                    "kvcloud uploader: stored the chunks queued at stop in %.2f s",
                    time.monotonic() - started,
                )
            return 0
        dropped = self._busy + self._give_up()
        self.count(upload_dropped_at_stop=dropped)
        log.warning(
            "kvcloud uploader: %d chunks not stored %.1f s after stop (the drain budget): "
            "lost, future misses. Give vLLM's workers more time to stop "
            "(--shutdown-timeout, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS; docs/VLLM.md)",
            dropped,
            time.monotonic() - started,
        )
        return dropped

    def _give_up(self) -> int:
        """Empty the queue without pushing (each chunk's ``done`` still called, so its
        buffer goes back), then leave the stop marker, so the thread ends once its push
        under way does; returns how many chunks were taken out."""
        taken = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                continue
            taken += 1
            done = item[4]
            if done is not None:
                done()
        # (full again only if a chunk was offered meanwhile: no step runs at stop)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        return taken


def worker_stop_timeout(env: Mapping[str, str] | None = None) -> float:
    """VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS as vLLM reads it (vllm/envs.py: 5 when unset),
    without importing vLLM here."""
    raw = (os.environ if env is None else env).get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5")
    try:
        return float(int(raw))
    except ValueError:  # vLLM itself fails at start on such a value
        return 5.0


def stop_budget(setting: float, shutdown_timeout: float, worker_timeout: float) -> float:
    """Seconds the uploader may drain its queue at stop: ``setting`` when positive, never
    more than vLLM lets a worker live once it begins to stop, less a margin for vLLM's own
    teardown after the connector's (freeing the model and caches, the distributed state).

    vLLM 0.32 gives a stopping worker two windows. The engine core waits
    ``worker_timeout`` (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s) for it to exit, then
    sends SIGTERM and, 4 s later, SIGKILL (v1/executor/multiproc_executor.py,
    ``_ensure_worker_termination``). And the API server gives the engine core
    ``shutdown_timeout`` seconds (``--shutdown-timeout``) from its SIGTERM, then kills the
    engine core and its workers (v1/utils.py ``shutdown``): with the default 0 it kills
    them at once, so nothing queued survives a stop whatever this returns. An engine
    started without that API server (the offline ``LLM``) reads 0 too but does not kill at
    once: only ``worker_timeout`` is known to bound the worker then."""
    limit = float(worker_timeout)
    if shutdown_timeout > 0:
        limit = min(limit, float(shutdown_timeout))
    budget = max(0.0, limit - max(1.0, 0.2 * limit))
    return min(budget, setting) if setting > 0 else budget
