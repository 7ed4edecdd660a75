"""Background uploader: pushes evicted (or, write-through, freshly filled) pages.

Decoding never waits for it: ``offer`` copies nothing and never blocks — when the bounded
queue is full the page is dropped and counted (it will simply be recomputed if needed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcloud import KVCloud, KVCloudError, Namespace

log = logging.getLogger("kvcloud.worker.uploader")


@dataclass
class UploadItem:
    fp: bytes
    parent: bytes
    kv: np.ndarray  # a host copy the uploader owns
    on_done: Callable[[str | None], None] | None = None  # the object key, None if it failed
    tenant: str | None = None  # whose fps: kvcloud encrypts for tenants that want it


class Uploader:
    def __init__(
        self,
        kv: KVCloud,
        ns: Namespace,
        maxsize: int,
        on_result: Callable[[str, int], None] | None = None,
        busy_duty: float = 0.05,
    ) -> None:
        self.kv = kv
        self.ns = ns
        self._q: queue.Queue[UploadItem | None] = queue.Queue(maxsize=max(1, maxsize))
        self._on_result = on_result or (lambda result, nbytes: None)
        self._idle = threading.Event()
        self._idle.set()
        # While requests run, uploads take at most this share of wall time: on a CPU-bound
        # worker the uploader's Python work competes for the GIL and the cores with decoding
        # (and a nice value does not cover the GIL). Between requests it runs flat out.
        self.busy_duty = busy_duty
        self._fg_idle = threading.Event()
        self._fg_idle.set()
        self._inflight = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvcloud-uploader", daemon=True)
        self._thread.start()

    def foreground(self, busy: bool) -> None:
        """The engine says whether a request is running."""
        if busy:
            self._fg_idle.clear()
        else:
            self._fg_idle.set()

    @property
    def depth(self) -> int:
        return self._q.qsize()

    def offer(self, item: UploadItem) -> bool:
        """Queue a page for upload; False (and counted as dropped) if the queue is full."""
        with self._lock:
            try:
                self._q.put_nowait(item)
            except queue.Full:
                self._on_result("dropped", 0)
                return False
            self._inflight += 1
            self._idle.clear()
        return True

    def _run(self) -> None:
        # Uploads are background work: on a box where torch keeps every core busy, a
        # full-priority uploader would steal decode time. Linux lets a thread lower its own
        # priority (its native id is a task id); elsewhere this is a no-op.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            item = self._q.get()
            if item is None:
                return
            started = time.perf_counter()
            key: str | None = None
            try:
                res = self.kv.push_chunks(
                    self.ns, [(item.fp, item.parent, item.kv)], tenant=item.tenant
                )
                key = res.keys[0]
                self._on_result("ok", res.bytes_written)
            except (KVCloudError, OSError) as exc:
                log.warning("upload of %s failed: %s", item.fp.hex()[:16], exc)
                self._on_result("failed", 0)
            except Exception:  # the thread must survive anything a single page throws
                log.exception("upload of %s crashed", item.fp.hex()[:16])
                self._on_result("failed", 0)
            if item.on_done is not None:
                item.on_done(key)
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.set()
            if not self._fg_idle.is_set() and 0 < self.busy_duty < 1:
                spent = time.perf_counter() - started
                # back off, but wake at once when the request finishes
                self._fg_idle.wait(spent * (1 - self.busy_duty) / self.busy_duty)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued upload finished; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        self.drain(timeout)
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=max(0.1, deadline - time.monotonic()))
        self._thread.join(max(0.1, deadline - time.monotonic()))
