"""The request path: local prefix pages, then kvcloud, then prefill only the rest.

One engine serves one model. Requests are serialised by a lock (a CPU-first worker gains
nothing from interleaving them, and it keeps page ownership simple); the uploader runs
beside it in a thread.

Page ownership: a sequence's page table is a list of ``Slot``s. A slot with a fingerprint
holds one reference on a shared full page in the prefix cache; a slot without one owns a
private page (a partial tail, or a copy made before writing into a shared page).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcloud import KVCloud, KVCloudError, Namespace, SessionNotFoundError
from kvcloud.config import redact_url
from kvcloud.namespace import (
    chunk_fingerprints,
    derive_tenant_key,
    next_fingerprint,
    tokens_array,
)
from kvcloud.stores import open_store

from .config import WorkerOptions
from .costmodel import CostModel
from .errors import (
    BadRequestError,
    CacheFullError,
    ContextLengthError,
    SessionUnknownError,
    StoreUnavailableError,
)
from .model import Decoder, preset, sample
from .pages import CachedPage, PagePool, PrefixCache, SeqPages
from .tokenizer import ByteTokenizer, Tokenizer
from .types import CompletionRequest, CompletionResult, FlushResult, SessionInfo
from .uploader import Uploader, UploadItem

log = logging.getLogger("kvcloud.worker")

_DEV_SECRET = "kvcloud-insecure-default-secret"


@dataclass
class Slot:
    page: int
    fp: bytes | None  # set: a reference on a shared prefix-cache page; None: private page


@dataclass
class LocalSession:
    session_id: str
    tenant: str
    tokens: list[int] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)  # KV of tokens[:kv_len]
    kv_len: int = 0
    dirty: bool = False  # history changed since the last flush
    stored: bool = False  # a record exists in the index
    busy: bool = False  # a request is using its slots right now


@dataclass
class _Acquired:
    slots: list[Slot]
    cached: int
    local: int = 0
    remote: int = 0


class Metrics:
    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcloud_worker_requests", "Completion requests served", ["status"], registry=r
        )
        self.tokens = Counter(
            "kvcloud_worker_prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["source"],
            registry=r,
        )
        self.generated = Counter("kvcloud_worker_generated_tokens", "Tokens generated", registry=r)
        self.evictions = Counter(
            "kvcloud_worker_pages_evicted", "Pages evicted from the pool", registry=r
        )
        self.uploads = Counter(
            "kvcloud_worker_uploads", "Background page uploads", ["result"], registry=r
        )
        self.upload_bytes = Counter(
            "kvcloud_worker_upload_bytes",
            "Bytes of new objects written by the uploader",
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvcloud_worker_upload_queue_depth", "Pages waiting to upload", registry=r
        )
        self.fallbacks = Counter(
            "kvcloud_worker_remote_fallbacks",
            "Remote chunks that could not be restored and were recomputed",
            registry=r,
        )
        self.ttft = Histogram(
            "kvcloud_worker_ttft_seconds",
            "Time to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.pages = Gauge(
            "kvcloud_worker_cache_pages", "Pool pages by state", ["state"], registry=r
        )
        self.sessions = Gauge("kvcloud_worker_sessions", "Sessions held by this worker", registry=r)
        self.flushes = Counter(
            "kvcloud_worker_session_flushes", "Session flushes", ["result"], registry=r
        )
        self.decisions = Counter(
            "kvcloud_worker_cost_decisions",
            "Remote hits: pulled in full, in part, or recomputed",
            ["decision"],
            registry=r,
        )
        self.bandwidth = Gauge(
            "kvcloud_worker_store_bandwidth_bytes", "Learnt pull bandwidth (bytes/s)", registry=r
        )
        # Latencies of the three remote operations: lookups sit on every request's critical
        # path, pulls replace prefill, pushes run in the background (and on flush).
        self.lookup_seconds = Histogram(
            "kvcloud_worker_lookup_seconds",
            "Index lookup of a prompt's chunks (one round trip)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5),
            registry=r,
        )
        self.pull_seconds = Histogram(
            "kvcloud_worker_pull_seconds",
            "Parallel pull of matched chunks into pages",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.push_seconds = Histogram(
            "kvcloud_worker_push_seconds",
            "Push of chunks (uploader pages and session flushes)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.pulled_bytes = Counter(
            "kvcloud_worker_pulled_bytes", "Bytes of verified objects pulled", registry=r
        )
        self.pushed_bytes = Counter(
            "kvcloud_worker_pushed_bytes",
            "Bytes of new objects written (uploader and flushes)",
            registry=r,
        )
        self.pull_failures = Counter(
            "kvcloud_worker_pull_failures",
            "Matched chunks that could not be pulled, by reason (missing, corrupt, unavailable)",
            ["reason"],
            registry=r,
        )
        self.verify_failures = Counter(
            "kvcloud_worker_verify_failures",
            "Pulled objects that failed verification (digest, header, decode) and were dropped",
            registry=r,
        )
        # Every known label value starts at 0: a series that first appears already at 1 hides
        # that first increase from rate()/increase(), so a dashboard would miss it.
        for metric, values in (
            (self.requests, ("ok", "error")),
            (self.tokens, ("local", "remote", "computed")),
            (self.uploads, ("ok", "dropped", "failed")),
            (self.flushes, ("ok", "failed")),
            (self.decisions, ("restore", "partial", "recompute")),
            (self.pull_failures, ("missing", "corrupt", "unavailable")),
        ):
            for value in values:
                metric.labels(value)


class _TimedPushes:
    """What the uploader sees as its client: the engine's KVCloud with push_chunks timed, so
    push latency is measured where the uploader spends it without changing the uploader."""

    def __init__(self, kv: KVCloud, metrics: Metrics) -> None:
        self._kv = kv
        self._metrics = metrics

    def push_chunks(self, *args: Any, **kwargs: Any) -> Any:
        with self._metrics.push_seconds.time():
            return self._kv.push_chunks(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


class Engine:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        if options.threads:
            torch.set_num_threads(options.threads)
        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer: Tokenizer
        if options.model_path:
            model_id, revision, extra = self._load_checkpoint(Path(options.model_path))
        else:
            self.cfg = preset(options.model, options.seed)
            self.model = Decoder(self.cfg, self.device)
            self.tokenizer = ByteTokenizer()
            model_id = f"kvcloud-preset-{self.cfg.name}"
            revision = f"seed-{self.cfg.seed}"
            extra = f"rope_theta={self.cfg.rope_theta}"
        self.model_name = self.cfg.name
        self.max_context = self.cfg.max_context
        self.c = options.chunk_tokens
        self.ns = Namespace(
            model=model_id,
            revision=revision,
            num_layers=self.cfg.n_layers,
            num_kv_heads=self.cfg.n_kv_heads,
            head_dim=self.cfg.head_dim,
            dtype=options.kv_dtype,
            chunk_tokens=self.c,
            extra=extra,
        )
        self.pool = PagePool(options.cache_pages, self.cfg, self.c, options.kv_dtype, self.device)
        self.prefix = PrefixCache()
        self.sessions: OrderedDict[tuple[str, str], LocalSession] = OrderedDict()
        self.metrics = Metrics(options.worker_id)
        self.registry = self.metrics.registry
        self._lock = threading.RLock()
        self._secret = (options.secret or _DEV_SECRET).encode("utf-8")
        self._tenant_keys: dict[str, bytes] = {}
        self.kv: KVCloud | None = None
        self.uploader: Uploader | None = None
        self.cost = CostModel(self.cfg, self.c, enabled=options.cost_model)
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcloud-probe")
        if options.store:
            # --remote-timeout bounds a request's wait on the store: botocore would retry a
            # timed-out read up to 5 times, so the request path gets at most two attempts
            store = open_store(
                options.store,
                connect_timeout=options.remote_timeout,
                read_timeout=options.remote_timeout,
                max_attempts=2,
            )
            self.kv = KVCloud.open(
                store=store,
                index=options.index,
                secret=self._secret,
                connect_timeout=options.remote_timeout,
                read_timeout=options.remote_timeout,
            )
            self.kv.store.prewarm()
            if options.write_policy != "off":
                self.uploader = Uploader(
                    _TimedPushes(self.kv, self.metrics),  # type: ignore[arg-type]
                    self.ns,
                    options.upload_queue,
                    self._on_upload,
                )
        self._calibrate()
        self._update_gauges()
        log.info(
            "worker %s: model %s on %s, %d pages of %d tokens (%s), store %s",
            options.worker_id,
            self.cfg.name,
            self.device,
            options.cache_pages,
            self.c,
            options.kv_dtype,
            redact_url(options.store) if options.store else "none",
        )

    # -- small helpers ----------------------------------------------------------------------

    def _tenant_key(self, tenant: str) -> bytes:
        key = self._tenant_keys.get(tenant)
        if key is None:
            key = self._tenant_keys[tenant] = derive_tenant_key(self._secret, tenant)
        return key

    def _load_checkpoint(self, path: Path) -> tuple[str, str, str]:
        """Model, tokenizer and the namespace fields of a Hugging Face checkpoint."""
        from . import hf

        ckpt = hf.inspect_checkpoint(path)
        dtype_name = self.options.model_dtype
        if dtype_name == "auto":
            # CPU matmuls in bf16/fp16 are slow and less exact; a GPU runs the checkpoint's
            dtype_name = "float32" if self.device.type == "cpu" else ckpt.saved_dtype
        self.cfg = ckpt.cfg
        self.model, digest = hf.load_model(ckpt, self.device, getattr(torch, dtype_name))
        self.tokenizer = hf.HFTokenizer(
            path, vocab_size=self.cfg.vocab_size, extra_eos=ckpt.eos_ids
        )
        # the compute dtype changes the KV bytes as much as the weights do
        extra = f"{hf.namespace_extra(self.cfg)};compute={dtype_name}"
        return f"hf-{ckpt.model_type}", f"sha256-{digest}", extra

    def _fps(self, tokens: list[int], tenant: str) -> list[bytes]:
        return chunk_fingerprints(self.ns, tokens, self._tenant_key(tenant))

    def _on_upload(self, result: str, nbytes: int) -> None:
        self.metrics.uploads.labels(result).inc()
        if nbytes:
            self.metrics.upload_bytes.inc(nbytes)
            self.metrics.pushed_bytes.inc(nbytes)
        if self.uploader is not None:
            self.metrics.queue_depth.set(self.uploader.depth)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.pages.labels("free").set(self.pool.free_count)
        m.pages.labels("cached_idle").set(self.prefix.evictable)
        m.pages.labels("in_use").set(
            self.pool.n_pages - self.pool.free_count - self.prefix.evictable
        )
        m.sessions.set(len(self.sessions))
        if self.uploader is not None:
            m.queue_depth.set(self.uploader.depth)

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
                and self.options.write_policy == "write-back"
            ):
                # the seed's policy: snapshot the segment as it leaves memory
                self.uploader.offer(
                    UploadItem(cp.fp, cp.parent, self._page_array(cp.page), tenant=cp.tenant)
                )
            self.pool.release(cp.page)
            return True
        # no idle page: let go of the least recently used idle session's pages
        for key, sess in self.sessions.items():
            if sess.slots and not sess.busy:
                if self.kv is not None and sess.dirty:
                    self._flush_locked(sess)
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
        def done(ok: bool, cp: CachedPage = cp) -> None:
            if ok:
                cp.stored = True

        assert self.uploader is not None
        self.uploader.offer(
            UploadItem(cp.fp, cp.parent, self._page_array(cp.page), done, tenant=cp.tenant)
        )

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
        self, acq: _Acquired, fps: list[bytes], tenant: str, *, costed: bool = True
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
        self, acq: _Acquired, m: Any, chunks: Sequence[Any]
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
                self.prefix.insert(ref.fp, ref.parent, page, stored=True, tenant=sub.tenant)
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

    def _restore_session(self, session_id: str, tenant: str) -> tuple[LocalSession, int, int]:
        """Load a session another worker flushed. Returns it with (local, remote) tokens."""
        if self.kv is None:
            raise SessionUnknownError(f"unknown session {session_id!r}")
        try:
            rec = self.kv.load_session(self.ns, session_id, tenant)
        except SessionNotFoundError:
            raise SessionUnknownError(f"unknown session {session_id!r}") from None
        except KVCloudError as exc:
            # the index is down or the record is unreadable: the history is unknown, so the
            # only correct answer is "try again" (503), not a guess and not "no such session"
            log.warning("could not load session %s: %s", session_id[:12], exc)
            raise StoreUnavailableError(
                f"session {session_id!r} could not be loaded from the index; retry"
            ) from None
        sess = LocalSession(session_id, tenant, tokens=[int(t) for t in rec.tokens], stored=True)
        acq = _Acquired(slots=[], cached=0)
        n_full = rec.kv_tokens // self.c
        fps = self._fps(sess.tokens[: n_full * self.c], tenant)
        # local pages first, then the index. A session's own history is always pulled, even
        # when the cost model would recompute: recomputed KV differs in the last bits from
        # what the conversation was computed with, and a moved session must continue
        # bit-identically.
        self._extend_with_chunks(acq, fps, tenant, costed=False)
        if acq.cached < n_full * self.c:
            # entries may have expired while the record still names the objects
            m = self.kv.session_match(self.ns, rec, tenant)
            self._pull_new_pages(acq, m, m.chunks[acq.cached // self.c :])
        if acq.cached == n_full * self.c and rec.tail_key is not None:
            page = self._alloc()
            if self.device.type == "cpu":
                n_tail = self.kv.pull_tail(self.ns, rec, self.pool.host_view(page), tenant)
            else:
                buf = np.empty(self.ns.kv_shape(self.c), self.ns.dtype_info.storage)
                n_tail = self.kv.pull_tail(self.ns, rec, buf, tenant)
                if n_tail:
                    self.pool.from_host(page, buf[:, :, :n_tail])
            if n_tail:
                acq.slots.append(Slot(page, None))
                acq.cached += n_tail
                acq.remote += n_tail
            else:
                self.pool.release(page)
        if acq.cached < rec.kv_tokens:
            self.metrics.fallbacks.inc()
        sess.slots, sess.kv_len = acq.slots, acq.cached
        return sess, acq.local, acq.remote

    # -- the request path -------------------------------------------------------------------

    def create_session(self, tenant: str) -> str:
        sid = "sess_" + secrets.token_hex(16)
        with self._lock:
            sess = LocalSession(sid, tenant)
            self.sessions[(tenant, sid)] = sess
            self._trim_sessions()
            if self.kv is not None:
                try:
                    self.kv.write_session(self.ns, sid, [], 0, [], None, tenant)
                    sess.stored = True
                except KVCloudError as exc:
                    log.warning("could not record new session: %s", exc)
            self._update_gauges()
        return sid

    def _trim_sessions(self) -> None:
        while len(self.sessions) > self.options.max_sessions:
            for key, sess in self.sessions.items():
                if not sess.busy:
                    if self.kv is not None and sess.dirty:
                        self._flush_locked(sess)
                    self._release_slots(sess.slots)
                    del self.sessions[key]
                    break
            else:
                return

    def complete(self, req: CompletionRequest) -> CompletionResult:
        if req.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1")
        if req.temperature < 0:
            raise BadRequestError("temperature must be >= 0")
        vocab = self.cfg.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in req.prompt_tokens):
            raise BadRequestError(f"token ids must be integers in [0, {vocab})")
        with self._lock:
            if self.uploader is not None:
                self.uploader.foreground(True)
            try:
                result = self._complete_locked(req)
            except Exception:
                self.metrics.requests.labels("error").inc()
                raise
            finally:
                if self.uploader is not None:
                    self.uploader.foreground(False)
            self.metrics.requests.labels("ok").inc()
            self._update_gauges()
            return result

    def _complete_locked(self, req: CompletionRequest) -> CompletionResult:
        t0 = time.perf_counter()
        tenant = req.tenant
        sess: LocalSession | None = None
        local = remote = 0
        if req.session_id is not None:
            key = (tenant, req.session_id)
            sess = self.sessions.get(key)
            if sess is None:
                sess, local, remote = self._restore_session(req.session_id, tenant)
                self.sessions[key] = sess
                self._trim_sessions()
            self.sessions.move_to_end(key)
        history = list(sess.tokens) if sess else []
        new = list(req.prompt_tokens)
        if req.add_bos and not history and self.tokenizer.bos_id is not None:
            new = [self.tokenizer.bos_id, *new]
        if not new:
            raise BadRequestError("the prompt is empty")
        tokens = history + new
        if len(tokens) + req.max_tokens > self.max_context:
            raise ContextLengthError(
                f"{len(tokens)} prompt tokens + {req.max_tokens} max_tokens exceed the "
                f"context of {self.max_context}"
            )
        tokens_array(tokens)  # validates ids for hashing
        fps = self._fps(tokens, tenant)

        if sess is not None:
            sess.busy = True
            acq = _Acquired(slots=sess.slots, cached=sess.kv_len, local=0, remote=0)
            # KV restored for this request counts as remote, resident KV as local
            acq.local = sess.kv_len - remote if not (local or remote) else local
            acq.remote = remote
            sess.slots, sess.kv_len = [], 0
        else:
            acq = _Acquired(slots=[], cached=0)
        try:
            if acq.cached % self.c == 0:
                self._extend_with_chunks(acq, fps, tenant)
            result = self._run(req, tokens, fps, acq, t0, sess)
        except BaseException:
            self._release_slots(acq.slots)
            if sess is not None:
                sess.busy = False
                sess.slots, sess.kv_len = [], 0
            raise
        return result

    def _run(
        self,
        req: CompletionRequest,
        tokens: list[int],
        fps: list[bytes],
        acq: _Acquired,
        t0: float,
        sess: LocalSession | None,
    ) -> CompletionResult:
        c = self.c
        slots = acq.slots
        cached = min(acq.cached, len(tokens))
        if cached == len(tokens):
            cached -= 1  # the last prompt token must run to produce logits
        local_tokens = min(acq.local, cached)
        remote_tokens = min(acq.remote, cached - local_tokens)
        # drop slots beyond what we keep (possible after rolling back one token)
        keep = -(-cached // c) if cached else 0
        if len(slots) > keep and cached % c == 0 and cached < len(slots) * c:
            keep = cached // c + 1  # the page holding position `cached` is rewritten
        while len(slots) > max(keep, 0):
            self._release_slots([slots.pop()])
        if cached % c or (slots and len(slots) * c > cached):
            self._make_private(slots, cached // c)
        computed = len(tokens) - cached

        def ensure(upto: int) -> None:  # pages for positions < upto
            while len(slots) * c < upto:
                slots.append(Slot(self._alloc(), None))

        ensure(len(tokens))
        seq = SeqPages(self.pool, [s.page for s in slots])
        inp = torch.tensor(tokens[cached:], dtype=torch.long)
        t_prefill = time.perf_counter()
        logits = self.model(inp, cached, seq)
        self.cost.observe_prefill(computed, cached, time.perf_counter() - t_prefill)
        chain = list(fps)
        for j in range(cached // c, len(tokens) // c):
            self._register_full(
                slots[j], chain[j], chain[j - 1] if j else self.ns.digest, req.tenant
            )
        gen: list[int] = []
        g = None
        if req.temperature > 0:
            g = torch.Generator().manual_seed(
                req.seed if req.seed is not None else secrets.randbits(63)
            )
        ttft = time.perf_counter() - t0
        pos = len(tokens)
        finish = "length"
        all_tokens = list(tokens)
        while True:
            tok = sample(logits, req.temperature, g)
            gen.append(tok)
            all_tokens.append(tok)
            if req.stop_at_eos and tok in self.tokenizer.eos_ids:
                finish = "stop"
                break
            if len(gen) >= req.max_tokens:
                break
            ensure(pos + 1)
            seq.pages = [s.page for s in slots]
            logits = self.model(torch.tensor([tok], dtype=torch.long), pos, seq)
            pos += 1
            if pos % c == 0:
                j = pos // c - 1
                parent = chain[j - 1] if j else self.ns.digest
                fp = next_fingerprint(parent, all_tokens[j * c : pos], self._tenant_key(req.tenant))
                chain.append(fp)
                self._register_full(slots[j], fp, parent, req.tenant)
        # pages past the KV we hold are not needed
        keep = -(-pos // c)
        while len(slots) > keep:
            self._release_slots([slots.pop()])
        total = time.perf_counter() - t0
        m = self.metrics
        m.ttft.observe(ttft)
        m.tokens.labels("local").inc(local_tokens)
        m.tokens.labels("remote").inc(remote_tokens)
        m.tokens.labels("computed").inc(computed)
        m.generated.inc(len(gen))
        if sess is not None:
            sess.tokens = all_tokens
            sess.slots, sess.kv_len = slots, pos
            sess.dirty = True
            sess.busy = False
        else:
            self._release_slots(slots)
        return CompletionResult(
            tokens=gen,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=len(tokens),
            tokens_local=local_tokens,
            tokens_remote=remote_tokens,
            tokens_computed=computed,
            session_tokens=len(all_tokens) if sess is not None else 0,
            ttft_ms=ttft * 1000.0,
            total_ms=total * 1000.0,
            session_id=sess.session_id if sess is not None else None,
        )

    # -- sessions ---------------------------------------------------------------------------

    def _get_session(self, session_id: str, tenant: str) -> LocalSession:
        sess = self.sessions.get((tenant, session_id))
        if sess is None:
            raise SessionUnknownError(f"unknown session {session_id!r}")
        return sess

    def _flush_locked(self, sess: LocalSession) -> FlushResult:
        if self.kv is None:
            return FlushResult(sess.session_id, len(sess.tokens), 0, 0, 0, stored=False)
        c = self.c
        n_full = sess.kv_len // c
        fps = self._fps(sess.tokens[: n_full * c], sess.tenant)
        chunks = []
        for j in range(n_full):
            parent = fps[j - 1] if j else self.ns.digest
            chunks.append((fps[j], parent, self._page_array(sess.slots[j].page)))
        try:
            with self.metrics.push_seconds.time():
                res = self.kv.push_chunks(self.ns, chunks, tenant=sess.tenant)
            if res.bytes_written:
                self.metrics.pushed_bytes.inc(res.bytes_written)
            tail_key = None
            if sess.kv_len % c:
                parent = fps[-1] if fps else self.ns.digest
                n_tail = sess.kv_len - n_full * c
                tail_key = self.kv.store_tail(
                    self.ns,
                    parent,
                    sess.tokens[n_full * c : sess.kv_len],
                    self._page_array(sess.slots[n_full].page, n_tail),
                    sess.tenant,
                )
            self.kv.write_session(
                self.ns, sess.session_id, sess.tokens, sess.kv_len, res.keys, tail_key, sess.tenant
            )
        except KVCloudError:
            self.metrics.flushes.labels("failed").inc()
            raise
        for s in sess.slots[:n_full]:
            cp = self.prefix.get(s.fp) if s.fp is not None else None
            if cp is not None:
                cp.stored = True
        sess.dirty = False
        sess.stored = True
        self.metrics.flushes.labels("ok").inc()
        return FlushResult(
            sess.session_id,
            len(sess.tokens),
            sess.kv_len,
            res.pushed,
            res.bytes_written,
            stored=True,
        )

    def flush_session(self, session_id: str, tenant: str) -> FlushResult:
        with self._lock:
            sess = self.sessions.get((tenant, session_id))
            if sess is None:
                if self.kv is not None:
                    try:
                        rec = self.kv.load_session(self.ns, session_id, tenant)
                        return FlushResult(session_id, rec.n_tokens, rec.kv_tokens, 0, 0, True)
                    except KVCloudError:
                        pass
                raise SessionUnknownError(f"unknown session {session_id!r}")
            try:
                return self._flush_locked(sess)
            except KVCloudError as exc:
                # the details (endpoints, object keys) go to the log, not to the client
                log.warning("flush of %s failed: %s", session_id[:12], exc)
                raise StoreUnavailableError(
                    "flush failed: the store is unavailable; retry"
                ) from None

    def session_info(self, session_id: str, tenant: str) -> SessionInfo:
        with self._lock:
            sess = self.sessions.get((tenant, session_id))
            if sess is not None:
                return SessionInfo(
                    session_id,
                    len(sess.tokens),
                    sess.kv_len,
                    resident=True,
                    stored=sess.stored,
                    extra={"dirty": sess.dirty},
                )
            if self.kv is not None:
                try:
                    rec = self.kv.load_session(self.ns, session_id, tenant)
                    return SessionInfo(
                        session_id,
                        rec.n_tokens,
                        rec.kv_tokens,
                        resident=False,
                        stored=True,
                        updated=rec.updated,
                    )
                except KVCloudError:
                    pass
            raise SessionUnknownError(f"unknown session {session_id!r}")

    def flush_all(self, timeout: float = 30.0) -> list[FlushResult]:
        """Shutdown: flush every session, then push idle cached pages (they are about to be
        evicted by the process exiting — write-back says snapshot them) within ``timeout``."""
        deadline = time.monotonic() + timeout
        results = []
        with self._lock:
            for sess in list(self.sessions.values()):
                if sess.dirty and self.kv is not None:
                    try:
                        results.append(self._flush_locked(sess))
                    except KVCloudError as exc:
                        log.warning("flush of %s failed: %s", sess.session_id[:12], exc)
            if self.uploader is not None and self.options.write_policy == "write-back":
                for cp in self.prefix.pages():
                    if time.monotonic() > deadline:
                        break
                    if not cp.stored:
                        self._offer_upload(cp)
        if self.uploader is not None:
            self.uploader.drain(max(0.1, deadline - time.monotonic()))
        return results

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

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "worker_id": self.options.worker_id,
            "model": self.cfg.name,
            "namespace": self.ns.id,
            "device": str(self.device),
            "chunk_tokens": self.c,
            "cache_pages": self.pool.n_pages,
            "free_pages": self.pool.free_count,
            "sessions": len(self.sessions),
            "store": redact_url(self.options.store) if self.options.store else None,
            "index": redact_url(self.options.index) if self.options.index else None,
            "write_policy": self.options.write_policy,
            "upload_queue": self.uploader.depth if self.uploader else 0,
        }

    def close(self) -> None:
        self._prober.shutdown(wait=False, cancel_futures=True)
        if self.uploader is not None:
            self.uploader.close()
        if self.kv is not None:
            self.kv.close()
