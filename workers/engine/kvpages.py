"""Page management: allocating KV pages, evicting from the prefix cache, and filling pages
from kvcloud (the local prefix cache first, then the index and the store).

Page ownership: a sequence's page table is a list of ``Slot``s. A slot with a fingerprint
holds one reference on a shared full page in the prefix cache; a slot without one owns a
private page (a partial tail, or a copy made before writing into a shared page).

``PagesMixin`` is one part of ``workers.engine.Engine``; it uses the engine's pool, prefix
cache, kvcloud client, cost model, metrics and lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcloud import KVCloud

from ..errors import (
    CacheFullError,
)
from .pages import CachedPage, SeqPages
from .uploader import UploadItem

log = logging.getLogger("kvcloud.worker")


@dataclass
class Slot:
    page: int
    fp: bytes | None  # set: a reference on a shared prefix-cache page; None: private page


@dataclass
class Acquired:
    slots: list[Slot]
    cached: int
    local: int = 0
    remote: int = 0


class PagesMixin:
    """Pages and the prefix cache (mixed into ``Engine``)."""

    def _page_array(self, page: int, n_tokens: int | None = None) -> np.ndarray:
        """Host copy of a page for pushing (the page itself may be reused meanwhile)."""
        return self.pool.to_host(page, n_tokens)

    def _calibrate(self) -> None:
        """Two scratch prefills: the first warms torch up, the second seeds the cost model's
        prefill rate, so the very first remote hit is judged on a measured speed."""
        # a chunk-sized prefill: short ones are dominated by per-layer overhead and would
        # overstate what recomputing a chunk costs
        n = min(256, self.max_context // 2, self.c * self.pool.n_pages)
        pages = []
        try:
            for _ in range(-(-n // self.c)):
                pages.append(self._alloc())
            seq = SeqPages(self.pool, pages)
            toks = torch.arange(n, dtype=torch.long) % self.cfg.vocab_size
            for _ in range(2):
                t0 = time.perf_counter()
                self.model(toks, 0, seq)
                elapsed = time.perf_counter() - t0
            self.cost.observe_prefill(n, 0, elapsed)
        finally:
            for p in pages:
                self.pool.release(p)

    def _probe(self, m: Any) -> None:
        """Re-measure the store off the request path with one chunk (verified, discarded)."""
        assert self.kv is not None
        kv = self.kv
        buf = np.empty(self.ns.kv_shape(self.c), self.ns.dtype_info.storage)

        def run() -> None:
            t0 = time.perf_counter()
            res = kv.pull_into(m, [buf])
            elapsed = time.perf_counter() - t0
            size = m.chunks[0].entry.size or self.ns.chunk_bytes
            self.cost.observe_pull(res.bytes if res.chunks else size, elapsed)
            if self.cost.bandwidth:
                self.metrics.bandwidth.set(self.cost.bandwidth)

        self._prober.submit(run)

    # -- page allocation and eviction -------------------------------------------------------

    def _evict_one(self) -> bool:
        cp = self.prefix.pop_lru()
        if cp is not None:
            self.metrics.evictions.inc()
            if (
                self.uploader is not None
                and not cp.stored
                and not cp.uploading
                and self.options.write_policy == "write-back"
            ):
                # write-back: snapshot the segment as it leaves memory
                self.uploader.offer(
                    UploadItem(cp.fp, cp.parent, self._page_array(cp.page), tenant=cp.tenant)
                )
            self.pool.release(cp.page)
            return True
        # no idle page: let go of the least recently used idle session's pages
        for key, sess in self.sessions.items():
            if sess.slots and not sess.busy:
                if self.kv is not None and sess.dirty:
                    self._flush_if_current(sess)
                self._release_slots(sess.slots)
                sess.slots, sess.kv_len = [], 0
                self.sessions.move_to_end(key)
                return True
        return False

    def _alloc(self) -> int:
        page = self.pool.alloc()
        while page is None:
            if not self._evict_one():
                raise CacheFullError(
                    f"all {self.pool.n_pages} KV pages are in use; retry, or start the worker "
                    "with more --cache-pages"
                )
            page = self.pool.alloc()
        return page

    def _release_slots(self, slots: list[Slot]) -> None:
        for s in slots:
            if s.fp is None:
                self.pool.release(s.page)
            else:
                self.prefix.release(s.fp)

    def _register_full(self, slot: Slot, fp: bytes, parent: bytes, tenant: str) -> None:
        """A private page just became a full chunk: share it through the prefix cache."""
        if slot.fp is not None or fp in self.prefix:
            return  # already shared, or another copy is (keep ours private)
        cp = self.prefix.insert(fp, parent, slot.page, tenant=tenant)
        slot.fp = fp
        if self.uploader is not None and self.options.write_policy == "write-through":
            self._offer_upload(cp)

    def _offer_upload(self, cp: CachedPage) -> None:
        def done(key: str | None, cp: CachedPage = cp) -> None:
            cp.uploading = False
            if key is not None:
                cp.stored, cp.key = True, key

        assert self.uploader is not None
        # set before offering: the uploader's thread may finish (and clear it) before offer
        # returns
        cp.uploading = True
        if not self.uploader.offer(
            UploadItem(cp.fp, cp.parent, self._page_array(cp.page), done, tenant=cp.tenant)
        ):
            cp.uploading = False

    def _make_private(self, slots: list[Slot], index: int) -> None:
        """Copy-on-write before writing into a shared page."""
        s = slots[index]
        if s.fp is None:
            return
        page = self._alloc()
        self.pool.data[page].copy_(self.pool.data[s.page])
        self.prefix.release(s.fp)
        slots[index] = Slot(page, None)

    # -- prefix acquisition -----------------------------------------------------------------

    def _extend_with_chunks(
        self, acq: Acquired, fps: list[bytes], tenant: str, *, costed: bool = True
    ) -> None:
        """Append full chunks after acq.cached (chunk-aligned): local pages, then kvcloud."""
        i = acq.cached // self.c
        while i < len(fps):
            cp = self.prefix.acquire(fps[i])
            if cp is None:
                break
            acq.slots.append(Slot(cp.page, fps[i]))
            acq.local += self.c
            i += 1
        acq.cached = i * self.c
        if self.kv is None or i >= len(fps):
            return
        parent = fps[i - 1] if i else self.ns.digest
        with self.metrics.lookup_seconds.time():
            m = self.kv.lookup_fingerprints(self.ns, fps[i:], tenant, start=i, parent=parent)
        if not m.chunks:
            return
        sizes = [ref.entry.size or self.ns.chunk_bytes for ref in m.chunks]
        decision = self.cost.decide(i, sizes) if costed else self.cost.decide_all(sizes)
        if decision.chunks < len(m.chunks):
            self.metrics.decisions.labels("recompute" if decision.chunks == 0 else "partial").inc()
            if self.cost.should_probe():
                first_skipped = m.chunks[decision.chunks]
                self._probe(type(m)(m.ns, m.tenant, (first_skipped,), m.prompt_chunks))
        else:
            self.metrics.decisions.labels("restore").inc()
        if decision.chunks == 0:
            return
        attempted, ok, nbytes, elapsed = self._pull_new_pages(acq, m, m.chunks[: decision.chunks])
        if not attempted:
            return
        # a pull that delivered nothing in that time (stalled, unreachable) teaches the model
        # just as much as a fast one
        self.cost.observe_pull(nbytes if ok else sum(sizes[:attempted]), elapsed)
        if self.cost.bandwidth:
            self.metrics.bandwidth.set(self.cost.bandwidth)
        if ok < attempted:
            self.metrics.fallbacks.inc(attempted - ok)

    def _pull_new_pages(
        self, acq: Acquired, m: Any, chunks: Sequence[Any]
    ) -> tuple[int, int, int, float]:
        """Pull consecutive matched chunks that continue ``acq`` into newly allocated pages,
        as many as the pool can give; share each valid page through the prefix cache (kept
        private when another copy is cached already). Returns (chunks attempted, chunks
        restored, bytes pulled, seconds)."""
        pages: list[int] = []
        try:
            for _ in chunks:
                pages.append(self._alloc())
        except CacheFullError:
            pass  # restore what fits; the rest is recomputed
        if not pages:
            return 0, 0, 0, 0.0
        sub = type(m)(m.ns, m.tenant, tuple(chunks[: len(pages)]), m.prompt_chunks)
        t0 = time.perf_counter()
        ok, nbytes = self._pull(sub, pages)
        elapsed = time.perf_counter() - t0
        for j, page in enumerate(pages):
            ref = sub.chunks[j]
            if j >= ok:
                self.pool.release(page)
            elif ref.fp in self.prefix:
                acq.slots.append(Slot(page, None))
            else:
                self.prefix.insert(
                    ref.fp,
                    ref.parent,
                    page,
                    stored=True,
                    tenant=sub.tenant,
                    key=ref.entry.object_key,
                )
                acq.slots.append(Slot(page, ref.fp))
        acq.remote += ok * self.c
        acq.cached += ok * self.c
        return len(pages), ok, nbytes, elapsed

    def _pull(self, m: Any, pages: list[int]) -> tuple[int, int]:
        """Pull matched chunks into pages; returns (leading valid chunks, bytes pulled)."""
        assert self.kv is not None
        t0 = time.perf_counter()
        if self.device.type == "cpu":
            res = self.kv.pull_into(m, [self.pool.host_view(p) for p in pages])
        else:
            staging = [
                np.empty(self.ns.kv_shape(self.c), self.ns.dtype_info.storage) for _ in pages
            ]
            res = self.kv.pull_into(m, staging)
            for j in range(res.chunks):
                self.pool.from_host(pages[j], staging[j])
        self._observe_pull(res, time.perf_counter() - t0)
        return res.chunks, res.bytes

    def _observe_pull(self, res: Any, elapsed: float) -> None:
        m = self.metrics
        m.pull_seconds.observe(elapsed)
        if res.bytes:
            m.pulled_bytes.inc(res.bytes)
        for _position, reason in res.failures:
            # the client's reasons: "missing", "unavailable", "corrupt:<ErrorClass>"
            kind = reason.split(":", 1)[0]
            m.pull_failures.labels(kind).inc()
            if kind == "corrupt":
                m.verify_failures.inc()

    def push_cached_pages(self, kv: KVCloud | None = None) -> int:
        """Synchronously push every cached full page not yet stored (to ``kv``, or this
        engine's store); returns bytes written. For benchmarks and planned shutdowns."""
        target = kv or self.kv
        if target is None:
            return 0
        written = 0
        with self._lock:
            by_tenant: dict[str | None, list[tuple[bytes, bytes, Any]]] = {}
            for cp in self.prefix.pages():
                if kv is not None or not cp.stored:
                    by_tenant.setdefault(cp.tenant, []).append(
                        (cp.fp, cp.parent, self._page_array(cp.page))
                    )
            # one push per tenant: the tenant decides whether its objects are encrypted
            for tenant, chunks in by_tenant.items():
                written += target.push_chunks(self.ns, chunks, tenant=tenant).bytes_written
            if kv is None:
                for cp in self.prefix.pages():
                    cp.stored = True
        return written

    def clear_cache(self) -> int:
        """Forget every idle cached page without uploading it (benchmarks, tests); returns
        how many were dropped. Pages held by sessions or requests stay."""
        dropped = 0
        with self._lock:
            while (cp := self.prefix.pop_lru()) is not None:
                self.pool.release(cp.page)
                dropped += 1
            self._update_gauges()
        return dropped
