"""Lookup and pull: find the longest cached prefix of a prompt, and fetch its KV verified.

Reliability rules (invariants 3 and 4) enforced here:
- pull verifies every object (digest = key, header = what was asked) and turns a missing or
  corrupt one into a shorter match, dropping the bad entry, instead of raising; an object
  that fails to decrypt is a corrupt object like any other: a miss;
- lookup and pull treat an unreachable index or store as a miss (logged and counted): the
  caller recomputes, nobody gets an error on the inference path.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import (
    CorruptObjectError,
    DigestMismatchError,
    IndexBackendError,
    KVCloudError,
    LayoutError,
    ObjectNotFoundError,
    StoreError,
)
from ..indexes.base import IndexEntry
from ..namespace import Namespace
from ..segment import digest_from_key, part_layout, part_record_fp, read_segment_into
from .base import ClientBase, hex_fps, log
from .results import ChunkRef, Match, PullResult


def _grid(ns: Namespace, entry: IndexEntry) -> list[tuple[int, int, int, int]] | None:
    """Every part an entry names as (layer lo, layer hi, head lo, head hi), in key order;
    None when the entry's layout cannot be a chunk of ``ns`` (stages that do not tile its
    layers, parts that do not split its heads)."""
    out: list[tuple[int, int, int, int]] = []
    at = 0
    for layers, keys in entry.stages:
        lo, hi = layers if layers is not None else (0, ns.num_layers)
        if lo != at or hi <= lo or ns.num_kv_heads % len(keys):
            return None
        w = ns.num_kv_heads // len(keys)
        out += [(lo, hi, j * w, (j + 1) * w) for j in range(len(keys))]
        at = hi
    return out if at == ns.num_layers else None


class PullMixin(ClientBase):
    """KVCloud's lookup and pull side."""

    # -- lookup -----------------------------------------------------------------------------

    def lookup(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, tenant: str | None = None
    ) -> Match:
        """The longest cached prefix, in one index round trip. Never raises for a backend
        outage: an unreachable index is an empty match (logged and counted)."""
        t = self._tenant(tenant)
        fps = self.fingerprints(ns, tokens, t)
        return self.lookup_fingerprints(ns, fps, tenant=t)

    def lookup_fingerprints(
        self,
        ns: Namespace,
        fps: Sequence[bytes],
        tenant: str | None = None,
        *,
        start: int = 0,
        parent: bytes | None = None,
        strict: bool = False,
    ) -> Match:
        """Lookup for precomputed fps. ``start`` is the chunk position of ``fps[0]`` and
        ``parent`` the fp before it (the namespace digest when start is 0) — used when the
        first chunks are already in local memory and only the rest is asked for.

        An unreachable index is an empty match (logged and counted); with ``strict`` the
        ``IndexBackendError`` is raised after being counted, for callers that keep their
        own account of outages (a circuit breaker)."""
        t = self._tenant(tenant)
        if parent is None:
            if start != 0:
                raise LayoutError("lookup_fingerprints needs parent= when start > 0")
            parent = ns.digest
        if not fps:
            return Match(ns, t, (), start)
        pending = self._drain_pending()
        pending["lookups"] = pending.get("lookups", 0) + 1
        try:
            # Only the leading run of hits is usable (a chunk needs every chunk before it),
            # so the index may stop reading at the first miss.
            entries = self.index.lookup_run(ns.id, hex_fps(fps), counters=pending)
        except IndexBackendError as exc:
            self._restore_pending(pending)
            self._count(index_errors=1, lookups=1, chunks_missed=len(fps))
            if strict:
                raise
            log.warning("index lookup failed, treating as a miss: %s", exc)
            return Match(ns, t, (), start + len(fps))
        hits: list[ChunkRef] = []
        for i, (fp, entry) in enumerate(zip(fps, entries, strict=False)):
            hits.append(ChunkRef(start + i, fp, parent, entry))
            parent = fp
        with self._lock:  # "lookups" already reached the index with this round trip
            self._stats["lookups"] += 1
        self._count(chunks_hit=len(hits), chunks_missed=len(fps) - len(hits))
        return Match(ns, t, tuple(hits), start + len(fps))

    # -- pull -------------------------------------------------------------------------------

    def pull(self, m: Match, out: np.ndarray | None = None) -> np.ndarray:
        """KV of the matched prefix, bit-identical to what was pushed.

        Returns ``[layers, 2, n, kv_heads, head_dim]``; ``n == m.tokens`` unless an object was
        missing or corrupt, in which case n stops before it (the entry is dropped and the
        failure counted). With ``out`` (at least ``m.tokens`` long on axis 2), fills it and
        returns a view of it.
        """
        return self.pull_detailed(m, out).array

    def pull_detailed(self, m: Match, out: np.ndarray | None = None) -> PullResult:
        ns = m.ns
        c = ns.chunk_tokens
        storage = np.dtype(ns.dtype_info.storage)
        if out is None:
            out = np.empty(ns.kv_shape(m.tokens), dtype=storage)
        else:
            out = ns.check_array(out)
            if out.shape[2] < m.tokens:
                raise LayoutError(f"out holds {out.shape[2]} tokens, the match {m.tokens}")
        dests = [out[:, :, i * c : (i + 1) * c] for i in range(len(m.chunks))]
        n_ok, failures, nbytes = self._pull_into(m, dests)
        return PullResult(out[:, :, : n_ok * c], n_ok * c, n_ok, nbytes, failures)

    def pull_into(
        self,
        m: Match,
        dests: Sequence[np.ndarray],
        *,
        heads: tuple[int, int] | None = None,
        layers: tuple[int, int] | None = None,
        on_layer: Callable[[int, int], None] | None = None,
    ) -> PullResult:
        """Pull chunk i of the match into ``dests[i]`` (e.g. free KV-cache pages).

        ``on_layer(i, l)`` is called (on a pull thread) once layer l of chunk i is verified
        in ``dests[i]``: as soon as its bytes are in, for a chunk stored as one format 3
        object, so the caller can use layer l while layer l + 1 is still in flight; after
        the whole chunk otherwise. A chunk that fails may have handed over some layers.
        An exception ``on_layer`` raises ends the pull (the chunks not yet started are not
        read) and propagates: how a caller that no longer wants the rest stops it.

        With ``heads`` (lo, hi) the destinations hold only KV heads [lo, hi) of the
        namespace's (``[layers, 2, chunk_tokens, hi - lo, head_dim]``: what one tensor-parallel
        rank holds), and only those are pulled: from a chunk stored in parts, the parts that
        overlap them; from one stored whole, the object, of which they are kept. With
        ``layers`` (lo, hi) likewise for layers (what one pipeline stage holds: destinations
        ``[hi - lo, 2, ...]``, and ``on_layer`` counts from the first of them)."""
        if len(dests) < len(m.chunks):
            raise LayoutError(f"{len(dests)} destinations for {len(m.chunks)} chunks")
        c = m.ns.chunk_tokens
        if heads is None and layers is None:
            dests = [m.ns.check_array(d, c) for d in dests[: len(m.chunks)]]
        else:
            n_layers, n_heads, dim = part_layout(m.ns, heads, layers)
            want = (n_layers, 2, c, n_heads, dim)
            for d in dests[: len(m.chunks)]:
                if tuple(d.shape) != want or d.dtype.itemsize != m.ns.dtype_info.itemsize:
                    raise LayoutError(
                        f"a destination for KV heads {heads or 'all'}, layers {layers or 'all'} "
                        f"is {list(want)} of {m.ns.dtype}, got {list(d.shape)} of {d.dtype}"
                    )
        n_ok, failures, nbytes = self._pull_into(m, dests, heads, on_layer, layers)
        empty = np.empty(m.ns.kv_shape(0), dtype=m.ns.dtype_info.storage)
        return PullResult(empty, n_ok * c, n_ok, nbytes, failures)

    def _pull_into(
        self,
        m: Match,
        dests: Sequence[np.ndarray],
        heads: tuple[int, int] | None = None,
        on_layer: Callable[[int, int], None] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> tuple[int, list[tuple[int, str]], int]:
        ns = m.ns
        dkey = self.data_key(m.tenant)
        must_encrypt = self.encrypts(m.tenant)
        lo, hi = heads if heads is not None else (0, ns.num_kv_heads)
        l_lo, l_hi = layers if layers is not None else (0, ns.num_layers)
        # the part of a chunk stored in parts that was missing or bad, by chunk: its record
        # is dropped with the entry, or the next writer to offer a part of that chunk would
        # find every record still there and register the broken grid again
        bad_parts: dict[int, tuple[str, tuple[int, int], tuple[int, int]]] = {}
        # objects whose bytes do not hash to their own key: garbage to every reader. Deleted
        # after their entries (invariant 6), or a re-push of the same chunk (the same key,
        # where the KV is recomputed bit for bit) finds the object "already there" and names
        # the damaged bytes again. Any other verify failure (a header naming another chunk,
        # another deployment's key) may be a good object under a wrong entry: kept.
        damaged: set[str] = set()

        def fetch(i: int) -> tuple[str, int]:
            ref = m.chunks[i]
            keys = ref.entry.keys
            if len(keys) == 1 and heads is None and layers is None:
                layer_done = None if on_layer is None else functools.partial(on_layer, i)
                return fetch_object(ref, keys[0], dests[i], None, None, layer_done)
            reason, size = fetch_parts(i)
            if reason == "ok" and on_layer is not None:
                for layer in range(l_hi - l_lo):  # every part is in: each layer is
                    on_layer(i, layer)
            return reason, size

        def fetch_parts(i: int) -> tuple[str, int]:
            ref = m.chunks[i]
            keys, grid = ref.entry.keys, _grid(ns, ref.entry)
            if grid is None:
                log.warning("entry %s names parts that are not a grid of %d layers × %d KV "
                            "heads: %s", ref.fp.hex()[:16], ns.num_layers, ns.num_kv_heads,
                            ref.entry.object_key[:200])  # fmt: skip
                return "corrupt:parts", 0
            total = 0
            for key, (pl_lo, pl_hi, p_lo, p_hi) in zip(keys, grid, strict=True):
                a, b = max(p_lo, lo), min(p_hi, hi)
                la, lb = max(pl_lo, l_lo), min(pl_hi, l_hi)
                if a >= b or la >= lb:
                    continue  # a part holding none of the heads or layers asked for
                # the range a part's header names: None where it holds all of them
                part = None if (p_lo, p_hi) == (0, ns.num_kv_heads) else (p_lo, p_hi)
                stage = None if (pl_lo, pl_hi) == (0, ns.num_layers) else (pl_lo, pl_hi)
                target = dests[i][la - l_lo : lb - l_lo, :, :, a - lo : b - lo]
                if (a, b, la, lb) == (p_lo, p_hi, pl_lo, pl_hi):
                    reason, size = fetch_object(ref, key, target, part, stage)
                else:
                    # an object wider than what is asked for: pulled whole, sliced here
                    room = np.empty(
                        (pl_hi - pl_lo, 2, ns.chunk_tokens, p_hi - p_lo, ns.head_dim),
                        dtype=dests[i].dtype,
                    )
                    reason, size = fetch_object(ref, key, room, part, stage)
                    if reason == "ok":
                        target[...] = room[la - pl_lo : lb - pl_lo, :, :, a - p_lo : b - p_lo]
                if reason != "ok":
                    if reason == "missing" or reason.startswith("corrupt"):
                        bad_parts[i] = (key, (p_lo, p_hi), (pl_lo, pl_hi))
                    return reason, 0
                total += size
            return "ok", total

        def fetch_object(
            ref: ChunkRef,
            key: str,
            dest: np.ndarray,
            part: tuple[int, int] | None,
            stage: tuple[int, int] | None,
            layer_done: Callable[[int], None] | None = None,
        ) -> tuple[str, int]:
            try:
                # stream straight into the destination (a KV page, or a chunk's slice of one
                # array, block by block): no copy of the object is ever held, and hashing
                # overlaps the transfer
                with self.store.open_read(key) as reader:
                    _, size = read_segment_into(
                        reader,
                        dest,
                        digest=digest_from_key(key),
                        ns=ns,
                        fp=ref.fp,
                        parent=ref.parent,
                        n_tokens=ns.chunk_tokens,
                        key=dkey,
                        require_encryption=must_encrypt,
                        heads=part,
                        layers=stage,
                        on_layer=layer_done,
                    )
                return "ok", size
            except ObjectNotFoundError:
                return "missing", 0
            except CorruptObjectError as exc:
                log.warning("object %s failed verification: %s", key, exc)
                if isinstance(exc, DigestMismatchError):
                    damaged.add(key)
                return f"corrupt:{type(exc).__name__}", 0
            except (StoreError, OSError) as exc:
                log.warning("store get %s failed: %s", key, exc)
                return "unavailable", 0

        n = len(m.chunks)
        if n == 0:
            return 0, [], 0
        if n == 1:
            outcomes = [fetch(0)]
        else:
            futures = [self.store.executor.submit(fetch, i) for i in range(n)]
            try:
                outcomes = [f.result() for f in futures]
            except BaseException:
                # (an on_layer that wants no more, or a bug): the fetches not started never
                # start, and the ones under way end before the exception reaches the caller,
                # who may hand the destinations to someone else
                for f in futures:
                    f.cancel()
                cf.wait(futures)
                raise
        n_ok = 0
        while n_ok < n and outcomes[n_ok][0] == "ok":
            n_ok += 1
        failures = [(m.chunks[i].position, r) for i, (r, _) in enumerate(outcomes) if r != "ok"]
        nbytes = sum(size for r, size in outcomes[:n_ok])
        dropped = 0
        for i, (reason, _) in enumerate(outcomes):
            if reason == "missing" or reason.startswith("corrupt"):
                ref = m.chunks[i]
                # the index is a hint: an entry whose object is gone or bad must not be
                # served again; compare-and-drop so a concurrent good re-push survives
                try:
                    if self.index.drop(ns.id, ref.fp.hex(), ref.entry.object_key):
                        dropped += 1
                    if i in bad_parts:
                        key, p_heads, stage = bad_parts[i]
                        # recorded with its layers by a pipeline stage, without them else
                        for rec_layers in {None, stage}:
                            record = part_record_fp(ref.fp, p_heads, rec_layers)
                            self.index.drop(ns.id, record.hex(), key)
                except KVCloudError as exc:
                    log.warning("could not drop bad entry %s: %s", ref.fp.hex()[:16], exc)
                    damaged.difference_update(ref.entry.keys)  # still named: kept for gc
        deleted = 0
        for key in sorted(damaged):
            try:
                self.store.delete(key)
                deleted += 1
            except (KVCloudError, OSError) as exc:  # read-only credentials: gc collects it
                log.warning("could not delete damaged object %s: %s", key, exc)
        self._count(
            chunks_pulled=n_ok,
            bytes_pulled=nbytes,
            tokens_restored=n_ok * ns.chunk_tokens,
            missing_objects=sum(1 for r, _ in outcomes if r == "missing"),
            verify_failures=sum(1 for r, _ in outcomes if r.startswith("corrupt")),
            store_errors=sum(1 for r, _ in outcomes if r == "unavailable"),
            entries_dropped=dropped,
            damaged_deleted=deleted,
        )
        return n_ok, failures, nbytes
