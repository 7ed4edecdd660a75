"""Push: store chunks' KV as objects and register them in the index.

Reliability rule (invariant 1) enforced here: push writes each object before its index entry,
so an entry never names an object that is not there yet (a chunk stored in parts follows the
same rule in parts.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import KVCloudError, LayoutError, PushError
from ..indexes.base import IndexEntry
from ..namespace import Namespace, tokens_array
from ..segment import encode_segment_parts
from .base import ClientBase, hex_fps
from .results import PushResult


class PushMixin(ClientBase):
    """KVCloud's push side."""

    def push(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv_array: np.ndarray,
        tenant: str | None = None,
        *,
        codec: str | None = None,
    ) -> PushResult:
        """Store every full chunk of the prefix that is not stored yet.

        ``kv_array`` is ``[layers, 2, T, kv_heads, head_dim]`` with T covering at least the
        full chunks of ``tokens``; a partial tail is not pushed (it cannot be shared by
        prefix; sessions store it separately). Raises PushError if any chunk failed, after
        registering those that succeeded.
        """
        toks = tokens_array(tokens)
        c = ns.chunk_tokens
        n_full = len(toks) // c
        arr = ns.check_array(kv_array)
        if not n_full * c <= arr.shape[2] <= len(toks):
            raise LayoutError(
                f"kv_array holds {arr.shape[2]} tokens; expected between {n_full * c} and "
                f"{len(toks)} for a {len(toks)}-token prefix"
            )
        fps = self.fingerprints(ns, toks[: n_full * c], tenant)
        parents = [ns.digest, *fps[:-1]]
        chunks = [(fps[i], parents[i], arr[:, :, i * c : (i + 1) * c]) for i in range(n_full)]
        return self.push_chunks(ns, chunks, codec=codec, tenant=tenant)

    def push_chunks(
        self,
        ns: Namespace,
        chunks: Sequence[tuple[bytes, bytes, np.ndarray]],
        *,
        codec: str | None = None,
        tenant: str | None = None,
    ) -> PushResult:
        """Store chunks given as (fp, parent fp, kv) — the worker's eviction path.

        Chunks that already have an index entry are skipped (one lookup round trip).
        ``tenant`` is the one whose fingerprint key made the fps: it decides whether (and
        under which key) the objects are encrypted.
        """
        result = PushResult(chunks=len(chunks), keys=[""] * len(chunks))
        if not chunks:
            return result
        # a lossy namespace has exactly one codec; KVCLOUD_CODEC picks among lossless ones
        codec = ns.quant or codec or self.config.codec
        version = self.config.segment_version
        key = self._write_key(tenant)
        existing = self.index.lookup(ns.id, hex_fps([fp for fp, _, _ in chunks]))
        todo: list[int] = []
        for i, entry in enumerate(existing):
            if entry is not None:
                result.already_indexed += 1
                result.keys[i] = entry.object_key
            else:
                todo.append(i)

        def store_one(i: int) -> tuple[int, str, bool, IndexEntry]:
            fp, parent, kv = chunks[i]
            # the object as parts: a raw chunk goes to the store without being copied
            seg = encode_segment_parts(ns, fp, parent, kv, codec=codec, key=key, version=version)
            okey = seg.key()
            created = self._put_or_revive(okey, seg.parts)
            return i, okey, created, IndexEntry(okey, seg.header.n_tokens, seg.size, 0.0)

        errors: list[BaseException] = []
        if len(todo) == 1:
            outcomes: list[Any] = [self._attempt(store_one, todo[0])]
        else:
            outcomes = list(self.store.executor.map(lambda i: self._attempt(store_one, i), todo))
        stored: list[tuple[int, str, bool, IndexEntry]] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                errors.append(outcome)
                result.failed += 1
            else:
                stored.append(outcome)
        if stored:
            # every object is stored before any entry names it (invariant 1), and all the
            # entries go in one round trip
            now = time.time()
            try:
                self.index.register_many(
                    ns.id,
                    [
                        (chunks[i][0].hex(), IndexEntry(e.object_key, e.n_tokens, e.size, now))
                        for i, _, _, e in stored
                    ],
                )
            except KVCloudError as exc:
                errors.append(exc)
                result.failed += len(stored)
                stored = []
        for i, okey, created, _ in stored:
            # a reused object could have been collected between its touch and its entry (gc
            # deletes within one round trip of its last check): make sure it is still there
            if not created and self.store.head(okey) is None:
                fp, parent, kv = chunks[i]
                seg = encode_segment_parts(
                    ns, fp, parent, kv, codec=codec, key=key, version=version
                )
                self.store.put(okey, seg.parts)
        for i, key, created, entry in stored:
            result.keys[i] = key
            result.pushed += 1
            if created:
                result.objects_written += 1
                result.bytes_written += entry.size
        self._count(
            chunks_pushed=result.pushed,
            objects_written=result.objects_written,
            bytes_pushed=result.bytes_written,
            push_failures=result.failed,
        )
        if errors:
            raise PushError(
                f"{result.failed} of {len(todo)} chunks could not be stored: {errors[0]}", result
            ) from errors[0]
        return result

    @staticmethod
    def _attempt(fn: Any, arg: Any) -> Any:
        try:
            return fn(arg)
        except (KVCloudError, OSError) as exc:
            return exc

    def _put_or_revive(self, key: str, data: Any) -> bool:
        """Store an object; if it already exists, refresh its mtime so gc's grace period
        protects it until an entry or record names it (it may be an old orphan gc is about
        to collect). True if bytes were written."""
        if self.store.put(key, data):
            return True
        if self.store.touch(key):
            return False
        # it vanished between the two calls (collected just now): write it again
        return self.store.put(key, data)
