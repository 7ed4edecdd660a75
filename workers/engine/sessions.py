"""Sessions: a conversation's token history (and, for chat, its messages) with the KV pages
that hold it; created, restored from kvcloud on any worker, trimmed, flushed.

Behind a load balancer consecutive turns of one session land on different workers. With
``session_write_through`` (the default) two rules make that correct:

- **Write-through per turn.** Every turn ends by writing the session's record (token history,
  conversation, a fresh revision) to the index, before the answer completes (the JSON body,
  or the stream's ``[DONE]``), so the next turn on any worker sees it. The record names only
  KV objects already known stored, never a tail or chunk still on its way; the session's new
  full pages go to the background uploader, and a worker that restores the record finds them
  by fingerprint once they are there, or recomputes them (the index is a hint). Only an
  explicit flush, SIGTERM or trimming pushes everything synchronously, tail included.
- **Check before a turn.** A worker holding the session compares the stored record's
  revision with the one it last wrote or read (one index read); if another worker wrote
  since, its resident copy is dropped and the record restored.

When the index cannot be reached, both degrade to "this worker's copy": a failed write is
logged and counted (``kvcloud_worker_session_writes_total{result="failed"}``) and the turn is
still answered, since its tokens are generated (and maybe streamed) already and a retry would
add the turn twice; a failed check uses the resident copy. Two turns of one session running
at once on two workers: the last record written wins.

``SessionsMixin`` is one part of ``workers.engine.Engine``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcloud import KVCloudError, SessionNotFoundError
from kvcloud.sessions import REVISION_KEY, SessionRecord, new_revision

from ..errors import (
    SessionUnknownError,
    StoreUnavailableError,
)
from .kvpages import Acquired, Slot
from .types import FlushResult, SessionInfo

log = logging.getLogger("kvcloud.worker")


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
    # a chat session's conversation (messages, assistant replies as generated); None for a
    # session driven by /v1/completions, whose history is plain concatenated tokens
    messages: list[dict[str, str]] | None = None
    # the revision of the record this copy last wrote or was loaded from (None: neither yet);
    # a different one in the index means another worker wrote the session since
    revision: str | None = None


class SessionsMixin:
    """Session bookkeeping and persistence (mixed into ``Engine``)."""

    def _restore_session(
        self, session_id: str, tenant: str, rec: SessionRecord | None = None
    ) -> tuple[LocalSession, int, int]:
        """Load a session another worker wrote (from ``rec`` when already read). Returns it
        with (local, remote) tokens."""
        if self.kv is None:
            raise SessionUnknownError(f"unknown session {session_id!r}")
        if rec is None:
            try:
                rec = self.kv.load_session(self.ns, session_id, tenant)
            except SessionNotFoundError:
                raise SessionUnknownError(f"unknown session {session_id!r}") from None
            except KVCloudError as exc:
                # the index is down or the record is unreadable: the history is unknown, so
                # the only correct answer is "try again" (503), not a guess and not "no such
                # session"
                log.warning("could not load session %s: %s", session_id[:12], exc)
                raise StoreUnavailableError(
                    f"session {session_id!r} could not be loaded from the index; retry"
                ) from None
        sess = LocalSession(
            session_id,
            tenant,
            tokens=[int(t) for t in rec.tokens],
            stored=True,
            messages=_messages_from(rec.meta),
            revision=_revision(rec),
        )
        acq = Acquired(slots=[], cached=0)
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

    def create_session(self, tenant: str) -> str:
        sid = "sess_" + secrets.token_hex(16)
        with self._lock:
            sess = LocalSession(sid, tenant)
            self.sessions[(tenant, sid)] = sess
            self._trim_sessions()
            if self.kv is not None:
                try:
                    self._write_record(sess, 0, [], None)
                except KVCloudError as exc:
                    log.warning("could not record new session: %s", exc)
            self._update_gauges()
        return sid

    def _trim_sessions(self) -> None:
        while len(self.sessions) > self.options.max_sessions:
            for key, sess in self.sessions.items():
                if not sess.busy:
                    if self.kv is not None and sess.dirty:
                        self._flush_if_current(sess)
                    self._release_slots(sess.slots)
                    del self.sessions[key]
                    break
            else:
                return

    # -- sessions ---------------------------------------------------------------------------

    def _get_session(self, session_id: str, tenant: str) -> LocalSession:
        sess = self.sessions.get((tenant, session_id))
        if sess is None:
            raise SessionUnknownError(f"unknown session {session_id!r}")
        return sess

    @property
    def _shares_sessions(self) -> bool:
        """Sessions are written through and checked per turn (see the module's docstring)."""
        return self.kv is not None and self.options.session_write_through

    def _write_record(
        self, sess: LocalSession, kv_tokens: int, keys: list[str], tail_key: str | None
    ) -> None:
        """Write the session's record under a new revision (KVCloudError if it failed)."""
        assert self.kv is not None
        rev = new_revision()
        meta: dict[str, Any] = {REVISION_KEY: rev}
        if sess.messages is not None:
            meta["messages"] = sess.messages
        self.kv.write_session(
            self.ns,
            sess.session_id,
            sess.tokens,
            kv_tokens,
            keys,
            tail_key,
            sess.tenant,
            meta=meta,
        )
        sess.revision = rev
        sess.stored = True

    def _newer_record(self, sess: LocalSession) -> SessionRecord | None:
        """The stored record if another worker wrote the session after this copy was last
        written or read here; None when this copy is current or the index cannot say."""
        assert self.kv is not None
        checks = self.metrics.session_checks
        try:
            rec = self.kv.load_session(self.ns, sess.session_id, sess.tenant)
        except SessionNotFoundError:
            # expired, or never written (the index was down): this copy is all there is, and
            # the turn's write recreates the record
            checks.labels("missing").inc()
            return None
        except KVCloudError as exc:
            # availability over strictness: a turn on the resident copy is right unless
            # another worker served this session meanwhile, which this worker cannot know
            log.warning(
                "session %s: stored record unreadable, using the resident copy: %s",
                sess.session_id[:12],
                exc,
            )
            checks.labels("unavailable").inc()
            return None
        if _revision(rec) == sess.revision:
            checks.labels("current").inc()
            return None
        checks.labels("stale").inc()
        log.info(
            "session %s: another worker wrote it since; restoring the stored record",
            sess.session_id[:12],
        )
        return rec

    def _drop_session(self, sess: LocalSession) -> None:
        """Forget a resident copy without writing it (a newer record replaces it)."""
        self._release_slots(sess.slots)
        sess.slots, sess.kv_len = [], 0
        self.sessions.pop((sess.tenant, sess.session_id), None)

    def _flush_if_current(self, sess: LocalSession) -> FlushResult | None:
        """Flush a session being let go (trimmed, evicted, shutdown) unless another worker
        wrote it since: writing this older copy would undo that worker's turns."""
        if self._shares_sessions and self._newer_record(sess) is not None:
            sess.dirty = False
            return None
        return self._flush_locked(sess)

    def _write_through(self, sess: LocalSession) -> None:
        """End of a turn: the record, synchronously, naming only the leading full chunks
        whose objects are known stored; the rest of the KV goes to the uploader.

        Why not push the new KV synchronously too: the tail changes every turn and a chunk
        is megabytes (hundreds of them for a large model), which every turn would wait for;
        the record alone is a few kilobytes. A record never names an object that is not
        stored yet (it could never exist if the upload is dropped or fails), and the worker
        that restores it pulls the named chunks, finds later ones by fingerprint once the
        uploader has stored them, and recomputes the rest.
        """
        if not self._shares_sessions:
            return
        c = self.c
        fps = self._fps(sess.tokens[: (sess.kv_len // c) * c], sess.tenant)
        keys: list[str] = []
        for fp in fps:
            cp = self.prefix.get(fp)
            if cp is None or cp.key is None:
                break
            keys.append(cp.key)
        if self.uploader is not None:
            for fp in fps[len(keys) :]:
                cp = self.prefix.get(fp)
                if cp is not None and not cp.stored and not cp.uploading:
                    self._offer_upload(cp)
        try:
            self._write_record(sess, len(keys) * c, keys, None)
        except KVCloudError as exc:
            # the turn is generated (and maybe streamed) already: answering it and keeping it
            # here beats a 503 the client would retry into a duplicated turn. The next turn
            # here writes again; a turn elsewhere sees the previous record.
            log.warning(
                "session %s: write-through failed, the turn is on this worker only: %s",
                sess.session_id[:12],
                exc,
            )
            self.metrics.session_writes.labels("failed").inc()
            return
        self.metrics.session_writes.labels("ok").inc()

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
            self._write_record(sess, sess.kv_len, res.keys, tail_key)
        except KVCloudError:
            self.metrics.flushes.labels("failed").inc()
            raise
        for fp, key in zip(fps, res.keys, strict=True):
            cp = self.prefix.get(fp)
            if cp is not None:
                cp.stored, cp.key = True, key
        sess.dirty = False
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
            if sess is not None and self._shares_sessions:
                newer = self._newer_record(sess)
                if newer is not None:
                    # another worker's turns are in the index already; this copy is older
                    self._drop_session(sess)
                    self._update_gauges()
                    return FlushResult(session_id, newer.n_tokens, newer.kv_tokens, 0, 0, True)
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
            rec = None
            if sess is not None and self._shares_sessions:
                rec = self._newer_record(sess)
                if rec is not None:  # what this worker holds is not the session any more
                    self._drop_session(sess)
                    self._update_gauges()
                    sess = None
            if sess is not None:
                return SessionInfo(
                    session_id,
                    len(sess.tokens),
                    sess.kv_len,
                    resident=True,
                    stored=sess.stored,
                    extra={"dirty": sess.dirty},
                )
            if rec is None and self.kv is not None:
                with contextlib.suppress(KVCloudError):
                    rec = self.kv.load_session(self.ns, session_id, tenant)
            if rec is not None:
                return SessionInfo(
                    session_id,
                    rec.n_tokens,
                    rec.kv_tokens,
                    resident=False,
                    stored=True,
                    updated=rec.updated,
                )
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
                        res = self._flush_if_current(sess)
                        if res is not None:
                            results.append(res)
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


def _revision(rec: SessionRecord) -> str:
    """What identifies one write of a record. A record from before revisions existed is
    identified by its timestamp, compared for equality only (never ordered), so the clocks
    of different machines still do not matter."""
    return rec.revision or f"updated:{rec.updated!r}"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _messages_from(meta: dict[str, Any]) -> list[dict[str, str]] | None:
    """A stored session's conversation; None for a completions session (or an unreadable
    one, whose chat turns are then refused rather than rendered from a guess)."""
    raw = meta.get("messages")
    if not isinstance(raw, list):
        return None
    out = []
    for m in raw:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out
