"""Sessions through the client: save a conversation's KV and its record, and resume it.

A session's full chunks are pushed like any prefix and its partial tail is stored as an
object of its own; the record (``kvcloud/sessions.py``) is written after every object it
names, as for index entries.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import (
    ConfigError,
    CorruptObjectError,
    LayoutError,
    ObjectNotFoundError,
    SessionNotFoundError,
    StoreError,
)
from ..indexes.base import IndexEntry
from ..namespace import Namespace, tail_fingerprint, tokens_array
from ..segment import decode_segment, digest_from_key, encode_segment
from ..sessions import SessionRecord, pack_record, unpack_record
from .base import log
from .pull import PullMixin
from .push import PushMixin
from .results import ChunkRef, Match, PullResult

_MAX_SESSION_ID = 256


class SessionsMixin(PushMixin, PullMixin):
    """KVCloud's session calls: built on push and pull."""

    @staticmethod
    def _check_session_id(session_id: str) -> None:
        if not isinstance(session_id, str) or not 0 < len(session_id) <= _MAX_SESSION_ID:
            raise ConfigError(f"session id must be 1..{_MAX_SESSION_ID} characters")

    def save_session(
        self,
        ns: Namespace,
        session_id: str,
        tokens: Sequence[int] | np.ndarray,
        kv_array: np.ndarray,
        tenant: str | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        ttl_seconds: int | None = None,
    ) -> SessionRecord:
        """Push every full chunk and the partial tail, then write the session record
        (objects before the record, as for entries). ``kv_array`` holds the KV of the first
        ``kv_array.shape[2]`` tokens (all of them, or all but the last sampled one)."""
        self._check_session_id(session_id)
        t = self._tenant(tenant)
        toks = tokens_array(tokens)
        arr = ns.check_array(kv_array)
        kv_tokens = arr.shape[2]
        if kv_tokens > len(toks):
            raise LayoutError(f"kv_array holds {kv_tokens} tokens, the session {len(toks)}")
        res = self.push(ns, toks[:kv_tokens], arr, t)
        c = ns.chunk_tokens
        n_full = kv_tokens // c
        tail_key = None
        if kv_tokens % c:
            parent = self.fingerprints(ns, toks[: n_full * c], t)[-1] if n_full else ns.digest
            tail_key = self.store_tail(
                ns, parent, toks[n_full * c : kv_tokens], arr[:, :, n_full * c :], t
            )
        return self.write_session(
            ns,
            session_id,
            toks,
            kv_tokens,
            res.keys,
            tail_key,
            t,
            meta=meta,
            ttl_seconds=ttl_seconds,
        )

    def store_tail(
        self,
        ns: Namespace,
        parent: bytes,
        tail_tokens: Sequence[int] | np.ndarray,
        tail_kv: np.ndarray,
        tenant: str | None = None,
    ) -> str:
        """Store a partial chunk (no index entry: only session records point at it)."""
        tfp = tail_fingerprint(ns, parent, tail_tokens, self.tenant_key(tenant))
        seg = encode_segment(
            ns,
            tfp,
            parent,
            tail_kv,
            codec=ns.quant or self.config.codec,
            key=self._write_key(tenant),
            version=self.config.segment_version,
        )
        key = seg.key()
        if self._put_or_revive(key, seg.data):
            self._count(objects_written=1, bytes_pushed=len(seg.data))
        return key

    def write_session(
        self,
        ns: Namespace,
        session_id: str,
        tokens: Sequence[int] | np.ndarray,
        kv_tokens: int,
        chunk_keys: Sequence[str],
        tail_key: str | None,
        tenant: str | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        ttl_seconds: int | None = None,
    ) -> SessionRecord:
        """Write the record for objects already stored (the worker's flush path)."""
        self._check_session_id(session_id)
        toks = tokens_array(tokens)
        c = ns.chunk_tokens
        if not 0 <= kv_tokens <= len(toks) or len(chunk_keys) != kv_tokens // c:
            raise LayoutError("chunk keys do not cover the session's KV tokens")
        if (tail_key is None) != (kv_tokens % c == 0):
            raise LayoutError("a tail key is needed exactly when kv_tokens is not chunk-aligned")
        record = SessionRecord(
            session_id=session_id,
            ns=ns.id,
            tokens=toks.astype("<u4", copy=True),
            kv_tokens=kv_tokens,
            chunk_keys=tuple(chunk_keys),
            tail_key=tail_key,
            updated=time.time(),
            meta=dict(meta or {}),
        )
        payload = pack_record(record)
        self.index.put_session(self.session_scope(tenant), session_id, payload, ttl_seconds)
        return record

    def load_session(
        self, ns: Namespace, session_id: str, tenant: str | None = None
    ) -> SessionRecord:
        """The session record of this tenant. Raises SessionNotFoundError."""
        self._check_session_id(session_id)
        raw = self.index.get_session(self.session_scope(tenant), session_id)
        if raw is None:
            raise SessionNotFoundError(f"no session {session_id!r} for this tenant")
        record = unpack_record(session_id, raw)
        toks = record.tokens
        if record.ns != ns.id:
            raise SessionNotFoundError(f"session {session_id!r} belongs to another namespace")
        c = ns.chunk_tokens
        if (
            not 0 <= record.kv_tokens <= len(toks)
            or len(record.chunk_keys) != record.kv_tokens // c
            or (record.tail_key is None) != (record.kv_tokens % c == 0)
        ):
            raise CorruptObjectError(f"session record {session_id!r} lists the wrong objects")
        return record

    def session_match(
        self, ns: Namespace, record: SessionRecord, tenant: str | None = None
    ) -> Match:
        """A Match over the record's full chunks (pull it with pull/pull_into). Fingerprints
        are recomputed from the record's tokens, so every object is verified as usual."""
        t = self._tenant(tenant)
        c = ns.chunk_tokens
        n_full = record.kv_tokens // c
        fps = self.fingerprints(ns, record.tokens[: n_full * c], t)
        parents = [ns.digest, *fps[:-1]]
        refs = tuple(
            ChunkRef(i, fps[i], parents[i], IndexEntry(record.chunk_keys[i], c, 0, 0.0))
            for i in range(n_full)
        )
        return Match(ns, t, refs, n_full)

    def pull_tail(
        self, ns: Namespace, record: SessionRecord, out: np.ndarray, tenant: str | None = None
    ) -> int:
        """Fill ``out`` (at least the tail's length on axis 2) with the session's partial
        chunk; returns its token count, or 0 if there is none or it is missing/corrupt."""
        if record.tail_key is None:
            return 0
        t = self._tenant(tenant)
        c = ns.chunk_tokens
        n_full = record.kv_tokens // c
        n_tail = record.kv_tokens - n_full * c
        parent = self.fingerprints(ns, record.tokens[: n_full * c], t)[-1] if n_full else ns.digest
        tfp = tail_fingerprint(
            ns, parent, record.tokens[n_full * c : record.kv_tokens], self.tenant_key(t)
        )
        try:
            data = self.store.get(record.tail_key)
            decode_segment(
                data,
                digest=digest_from_key(record.tail_key),
                ns=ns,
                fp=tfp,
                parent=parent,
                n_tokens=n_tail,
                out=ns.check_array(out)[:, :, :n_tail],
                key=self.data_key(t),
                require_encryption=self.encrypts(t),
            )
        except ObjectNotFoundError:
            self._count(missing_objects=1)
            return 0
        except CorruptObjectError as exc:
            log.warning("session tail %s failed verification: %s", record.tail_key, exc)
            self._count(verify_failures=1)
            return 0
        except (StoreError, OSError) as exc:
            log.warning("session tail %s could not be fetched: %s", record.tail_key, exc)
            self._count(store_errors=1)
            return 0
        self._count(bytes_pulled=len(data), tokens_restored=n_tail)
        return n_tail

    def pull_session(
        self, ns: Namespace, record: SessionRecord, tenant: str | None = None
    ) -> PullResult:
        """KV of a session's first ``kv_tokens`` tokens, verified chunk by chunk; stops at
        the first missing or bad object."""
        m = self.session_match(ns, record, tenant)
        c = ns.chunk_tokens
        out = np.empty(ns.kv_shape(record.kv_tokens), dtype=ns.dtype_info.storage)
        dests = [out[:, :, i * c : (i + 1) * c] for i in range(len(m.chunks))]
        n_ok, failures, nbytes = self._pull_into(m, dests)
        tokens_ok = n_ok * c
        if n_ok == len(m.chunks) and record.tail_key is not None:
            n_tail = self.pull_tail(ns, record, out[:, :, tokens_ok:], tenant)
            if n_tail:
                tokens_ok += n_tail
            else:
                failures.append((len(m.chunks), "tail"))
        return PullResult(out[:, :, :tokens_ok], tokens_ok, n_ok, nbytes, failures)

    def delete_session(self, session_id: str, tenant: str | None = None) -> bool:
        self._check_session_id(session_id)
        return self.index.delete_session(self.session_scope(tenant), session_id)
