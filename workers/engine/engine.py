"""The request path: local prefix pages, then kvcloud, then prefill only the rest.

One engine serves one model. Requests are serialised by a lock (a CPU-first worker gains
nothing from interleaving them, and it keeps page ownership simple); the uploader runs
beside it in a thread. Its other jobs live beside it: pages and the prefix cache in
``workers.engine.kvpages``, sessions in ``workers.engine.sessions``, metrics in
``workers.engine.metrics``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvcloud import KVCloud, Namespace
from kvcloud.namespace import (
    chunk_fingerprints,
    derive_tenant_key,
    next_fingerprint,
    tokens_array,
)
from kvcloud.stores import open_store
from kvcloud.urls import redact_url

from ..config import WorkerOptions
from ..errors import (
    BadRequestError,
    ContextLengthError,
)
from .costmodel import CostModel
from .kvpages import Acquired, PagesMixin, Slot
from .metrics import Metrics, TimedPushes
from .model import Decoder, preset, sample
from .pages import PagePool, PrefixCache, SeqPages
from .sessions import LocalSession, SessionsMixin, common_prefix
from .tokenizer import ByteTokenizer, Tokenizer
from .types import CompletionRequest, CompletionResult
from .uploader import Uploader

log = logging.getLogger("kvcloud.worker")


_DEV_SECRET = "kvcloud-insecure-default-secret"


class Engine(SessionsMixin, PagesMixin):
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
            quant="" if options.kv_codec == "lossless" else options.kv_codec,
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
                    TimedPushes(self.kv, self.metrics),  # type: ignore[arg-type]
                    self.ns,
                    options.upload_queue,
                    self._on_upload,
                )
        self._calibrate()
        self._update_gauges()
        log.info(
            "worker %s: model %s on %s, %d pages of %d tokens (%s, %s stored KV), store %s",
            options.worker_id,
            self.cfg.name,
            self.device,
            options.cache_pages,
            self.c,
            options.kv_dtype,
            options.kv_codec,
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

    def _render(self, messages: list[dict[str, str]], add_bos: bool) -> list[int]:
        """A conversation's model input: the chat template over all of it, tokenized."""
        try:
            text = self.tokenizer.apply_chat_template(messages)
        except ValueError as exc:  # no template, or the template's raise_exception()
            raise BadRequestError(str(exc)) from None
        tokens = self.tokenizer.encode(text)
        if add_bos and self.tokenizer.bos_id is not None:
            tokens = [self.tokenizer.bos_id, *tokens]
        if not tokens:
            raise BadRequestError("the prompt is empty")
        return tokens

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

    # -- the request path -------------------------------------------------------------------

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
            newer = None
            if sess is not None and self._shares_sessions:
                newer = self._newer_record(sess)
                if newer is not None:
                    self._drop_session(sess)
                    sess = None
            if sess is None:
                sess, local, remote = self._restore_session(req.session_id, tenant, newer)
                self.sessions[key] = sess
                self._trim_sessions()
            self.sessions.move_to_end(key)
        history = list(sess.tokens) if sess else []
        conversation: list[dict[str, str]] | None = None
        if req.messages is not None:
            if sess is None:
                raise BadRequestError("chat messages without a session are rendered by the caller")
            if sess.messages is None and sess.tokens:
                raise BadRequestError(
                    "this session holds a /v1/completions history; chat needs a new session"
                )
            conversation = [*(sess.messages or []), *req.messages]
            # the model input is the whole conversation as the chat template renders it, not
            # the history plus the new messages rendered alone: templates insert a default
            # system prompt before the first message and their own end-of-turn text after
            # each reply, which only a rendering of the whole conversation gets right
            tokens = self._render(conversation, req.add_bos)
            history = []
        else:
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
            # a chat turn re-renders the conversation: the session's KV serves only as far
            # as the new input agrees with the stored history (usually up to the last reply)
            kept = sess.kv_len if conversation is None else common_prefix(sess.tokens, tokens)
            kept = min(kept, sess.kv_len)
            acq = Acquired(slots=sess.slots, cached=kept, local=0, remote=0)
            # KV restored for this request counts as remote, resident KV as local
            acq.local = sess.kv_len - remote if not (local or remote) else local
            acq.remote = remote
            sess.slots, sess.kv_len = [], 0
        else:
            acq = Acquired(slots=[], cached=0)
        try:
            if acq.cached % self.c == 0:
                self._extend_with_chunks(acq, fps, tenant)
            result = self._run(req, tokens, fps, acq, t0, sess)
            if sess is not None and conversation is not None:
                reply = self.tokenizer.decode(result.tokens)
                sess.messages = [*conversation, {"role": "assistant", "content": reply}]
        except BaseException:
            self._release_slots(acq.slots)
            if sess is not None:
                sess.busy = False
                sess.slots, sess.kv_len = [], 0
            raise
        if sess is not None:
            # before the answer leaves: the next turn may go to any worker
            self._write_through(sess)
        return result

    def _run(
        self,
        req: CompletionRequest,
        tokens: list[int],
        fps: list[bytes],
        acq: Acquired,
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
            listening = req.on_token is None or req.on_token(tok)
            if req.stop_at_eos and tok in self.tokenizer.eos_ids:
                finish = "stop"
                break
            if len(gen) >= req.max_tokens or not listening:
                break  # a stream whose reader went away ends the turn here, consistently
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
