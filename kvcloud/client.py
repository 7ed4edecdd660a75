"""KVCloud: push, lookup and pull KV segments; save and resume sessions.

Reliability rules from DESIGN §4 live here:
- push writes each object before its index entry;
- pull verifies every object (digest = key, header = what was asked) and turns a missing or
  corrupt one into a shorter match, dropping the bad entry, instead of raising;
- lookup and pull treat an unreachable index or store as a miss (logged and counted): the
  caller recomputes, nobody gets an error on the inference path.

Encryption at rest is per tenant (``KVCloudConfig.encrypt_tenants``): every push, tail and
pull names its tenant, and the tenant's data key is derived here from the master secret
(crypto.py). An object that fails to decrypt is a corrupt object like any other: a miss.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._closing import Closing
from .config import KVCloudConfig
from .crypto import TenantKey, derive_data_key
from .errors import (
    ConfigError,
    CorruptObjectError,
    IndexBackendError,
    KVCloudError,
    LayoutError,
    ObjectNotFoundError,
    PushError,
    SessionNotFoundError,
    StoreError,
)
from .indexes.base import Index, IndexEntry
from .namespace import (
    Namespace,
    chunk_fingerprints,
    derive_tenant_key,
    tail_fingerprint,
    tokens_array,
)
from .segment import (
    decode_segment,
    digest_from_key,
    encode_segment,
    encode_segment_parts,
    part_layout,
    part_record_fp,
    read_segment_into,
)
from .sessions import SessionRecord, pack_record, unpack_record
from .stores.base import ObjectStore

log = logging.getLogger("kvcloud.client")

_MAX_SESSION_ID = 256


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One matched chunk: its position, fingerprints and index entry."""

    position: int
    fp: bytes
    parent: bytes
    entry: IndexEntry


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a prompt. ``tokens`` is a multiple of chunk_tokens."""

    ns: Namespace
    tenant: str
    chunks: tuple[ChunkRef, ...]
    prompt_chunks: int  # full chunks in the prompt that was looked up

    @property
    def tokens(self) -> int:
        return len(self.chunks) * self.ns.chunk_tokens

    @property
    def nbytes(self) -> int:
        """Stored size of the matched objects (what a pull transfers)."""
        return sum(c.entry.size for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class PushResult:
    chunks: int = 0  # full chunks in the prefix
    already_indexed: int = 0  # had an entry before this push (nothing written)
    pushed: int = 0  # newly registered entries
    objects_written: int = 0  # new objects (a pushed chunk may reuse an existing object)
    bytes_written: int = 0
    failed: int = 0
    keys: list[str] = field(default_factory=list)  # object key of every chunk, in order


@dataclass
class PullResult:
    array: np.ndarray  # [layers, 2, tokens, kv_heads, head_dim] view of the filled prefix
    tokens: int
    chunks: int
    bytes: int
    failures: list[tuple[int, str]] = field(default_factory=list)  # (chunk position, reason)


def _hex(fps: Sequence[bytes]) -> list[str]:
    return [fp.hex() for fp in fps]


def _stage_bounds(ns: Namespace, stages: Sequence[int] | None) -> tuple[int, ...]:
    """Pipeline stages' layer boundaries, checked: from 0 to the namespace's layers, rising."""
    bounds = tuple(int(b) for b in stages) if stages else (0, ns.num_layers)
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != ns.num_layers
        or any(a >= b for a, b in itertools.pairwise(bounds))
    ):
        raise LayoutError(f"stages {list(bounds)} do not split {ns.num_layers} layers")
    return bounds


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


class KVCloud(Closing):
    """The client. Thread-safe; use it as a context manager or call close()."""

    def __init__(self, store: ObjectStore, index: Index, config: KVCloudConfig | None = None):
        self.store = store
        self.index = index
        self.config = config or KVCloudConfig()
        self._keys: dict[str, bytes] = {}
        self._data_keys: dict[str, TenantKey] = {}
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()  # not yet added to the index's counters
        if self.config.insecure_secret:
            log.warning(
                "KVCLOUD_SECRET is not set: using the built-in development secret. Anyone "
                "with this code can compute your fingerprints; set a secret in production."
            )

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        store: str | ObjectStore | None = None,
        index: str | Index | None = None,
        *,
        secret: str | bytes | None = None,
        config: KVCloudConfig | None = None,
        **options: Any,
    ) -> KVCloud:
        """Open by URL (or with ready backends). Unset values come from the environment."""
        cfg = config or KVCloudConfig.from_env(
            store=store if isinstance(store, str) else None,
            index=index if isinstance(index, str) else None,
            secret=secret,
            **options,
        )
        if config is not None and secret is not None:
            cfg.secret = secret.encode() if isinstance(secret, str) else secret
        st = store if isinstance(store, ObjectStore) else cfg.open_store()
        try:
            ix = index if isinstance(index, Index) else cfg.open_index()
        except Exception:
            if not isinstance(store, ObjectStore):
                st.close()
            raise
        return cls(st, ix, cfg)

    @classmethod
    def from_env(cls, **options: Any) -> KVCloud:
        """KVCLOUD_STORE, KVCLOUD_INDEX, KVCLOUD_SECRET, … (see KVCloudConfig)."""
        return cls.open(**options)

    def close(self) -> None:
        try:
            self._flush_counters()
        finally:
            self.store.close()
            self.index.close()

    def __repr__(self) -> str:
        return f"KVCloud(store={self.store.url!r}, index={self.index.url!r})"

    # -- keys and fingerprints --------------------------------------------------------------

    def _tenant(self, tenant: str | None) -> str:
        return tenant if tenant is not None else self.config.tenant

    def tenant_key(self, tenant: str | None = None) -> bytes:
        t = self._tenant(tenant)
        with self._lock:
            key = self._keys.get(t)
            if key is None:
                key = self._keys[t] = derive_tenant_key(self.config.secret, t)
            return key

    def data_key(self, tenant: str | None = None) -> TenantKey:
        """The tenant's encryption key (derived from the master secret, cached). Used to
        decrypt whatever the tenant finds encrypted, whether or not it encrypts new pushes."""
        t = self._tenant(tenant)
        with self._lock:
            key = self._data_keys.get(t)
            if key is None:
                key = self._data_keys[t] = derive_data_key(self.config.secret, t)
            return key

    def encrypts(self, tenant: str | None = None) -> bool:
        """Whether this tenant's segments are encrypted at rest (KVCLOUD_ENCRYPT_TENANTS)."""
        return self.config.encrypts(self._tenant(tenant))

    def _write_key(self, tenant: str | None) -> TenantKey | None:
        return self.data_key(tenant) if self.encrypts(tenant) else None

    def session_scope(self, tenant: str | None = None) -> str:
        """Index scope of a tenant's sessions: derived from its key, so it is unguessable."""
        key = self.tenant_key(tenant)
        return hashlib.blake2b(key, digest_size=16, person=b"kvc-scope-v1").hexdigest()

    def fingerprints(
        self, ns: Namespace, tokens: Sequence[int] | np.ndarray, tenant: str | None = None
    ) -> list[bytes]:
        return chunk_fingerprints(ns, tokens, self.tenant_key(tenant))

    # -- statistics -------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                if v:
                    self._stats[k] += v
                    self._pending[k] += v

    def _drain_pending(self) -> dict[str, int]:
        with self._lock:
            pending = dict(self._pending)
            self._pending.clear()
        return pending

    def _restore_pending(self, pending: Mapping[str, int]) -> None:
        with self._lock:
            self._pending.update(pending)

    def _flush_counters(self) -> None:
        pending = self._drain_pending()
        if not pending:
            return
        try:
            self.index.incr(pending)
        except KVCloudError as exc:
            log.warning("could not flush counters to the index: %s", exc)

    def stats(self) -> dict[str, int]:
        """This client's counters since it was opened."""
        with self._lock:
            return dict(self._stats)

    # -- push -------------------------------------------------------------------------------

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
        existing = self.index.lookup(ns.id, _hex([fp for fp, _, _ in chunks]))
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

    def store_part(
        self,
        ns: Namespace,
        fp: bytes,
        parent: bytes,
        kv: np.ndarray,
        heads: tuple[int, int] | None,
        *,
        layers: tuple[int, int] | None = None,
        codec: str | None = None,
        tenant: str | None = None,
    ) -> tuple[str, int]:
        """Store one part of a chunk, KV heads [lo, hi) of the namespace's (``kv`` is
        ``[layers, 2, tokens, hi - lo, head_dim]``), as an object of its own, and return its
        key and size. ``layers`` (lo, hi) makes it a pipeline stage's part: only those layers
        (``kv`` ``[hi - lo, 2, ...]``); None for either means all of them. No index entry
        names it yet: ``offer_part`` (each writer, after its part is stored) registers the
        chunk once every part is in. Until then the chunk is a miss (DESIGN §4: no entry
        before its objects); a part never registered is collected by gc like any
        unreferenced object."""
        codec = ns.quant or codec or self.config.codec
        seg = encode_segment_parts(
            ns,
            fp,
            parent,
            kv,
            codec=codec,
            key=self._write_key(tenant),
            version=self.config.segment_version,
            heads=heads,
            layers=layers,
        )
        okey = seg.key()
        created = self._put_or_revive(okey, seg.parts)
        self._count(objects_written=int(created), bytes_pushed=seg.size if created else 0)
        return okey, seg.size

    def offer_part(
        self,
        ns: Namespace,
        fp: bytes,
        heads: tuple[int, int] | None,
        key: str,
        size: int,
        n_tokens: int,
        parts: int,
        *,
        layers: tuple[int, int] | None = None,
        stages: Sequence[int] | None = None,
    ) -> bool:
        """After ``store_part``: record this part in the index, and register the chunk if
        every one of its ``parts`` (equal head ranges) is recorded, in every pipeline stage:
        ``stages`` are the stages' layer boundaries (``[0, 2, 4]``: layers [0, 2) and [2, 4)),
        ``layers`` this part's stage; None for a chunk not split by layers. Each writer records its
        part before it reads the others', so of writers finishing together at least one
        sees them all, and the chunk's entry is written once (SET NX makes a second
        registration a no-op). No coordinator: a chunk becomes visible as soon as its last
        part is stored, whatever the engine does next. A part record sits under a
        fingerprint derived from the chunk's and the range (``part_record_fp``), which no
        prompt's chain ever asks for; it names the part's object (keeping it from gc) and
        expires with the index's TTL. True if this call registered the chunk."""
        if ns.num_kv_heads % parts:
            raise LayoutError(f"{parts} parts cannot split {ns.num_kv_heads} KV heads evenly")
        bounds = _stage_bounds(ns, stages)
        # the stages whose parts make the chunk: one of every layer without pipeline stages
        stage_rows = list(itertools.pairwise(bounds)) if layers is not None else [None]
        if (layers is None) != (len(bounds) == 2) or layers not in stage_rows:
            raise LayoutError(f"layers {layers} are not one of the stages {list(bounds)}")
        now = time.time()
        w = ns.num_kv_heads // parts
        mine = heads if heads is not None else (0, ns.num_kv_heads)
        self.index.register(
            ns.id, part_record_fp(fp, mine, layers).hex(), IndexEntry(key, n_tokens, size, now)
        )
        grid = [(stage, [(j * w, (j + 1) * w) for j in range(parts)]) for stage in stage_rows]
        found = self.index.lookup(
            ns.id,
            [part_record_fp(fp, h, stage).hex() for stage, hs in grid for h in hs],
        )
        if any(e is None for e in found):
            return False
        keys = [e.object_key for e in found if e is not None]
        total = sum(e.size for e in found if e is not None)
        if layers is None:
            return self.register_parts(ns, fp, keys, n_tokens, total)
        rows = [(stage, keys[s * parts : (s + 1) * parts]) for s, (stage, _) in enumerate(grid)]
        return self._register(ns, fp, IndexEntry.of_grid(rows, n_tokens, total, time.time()))

    def register_parts(
        self, ns: Namespace, fp: bytes, keys: Sequence[str], n_tokens: int, size: int
    ) -> bool:
        """Register a chunk stored in parts (``keys`` in head order, equal head ranges, each
        already stored by ``store_part``). True if the entry was created now."""
        if ns.num_kv_heads % len(keys):
            raise LayoutError(f"{len(keys)} parts cannot split {ns.num_kv_heads} KV heads evenly")
        return self._register(ns, fp, IndexEntry.of_parts(keys, n_tokens, size, time.time()))

    def _register(self, ns: Namespace, fp: bytes, entry: IndexEntry) -> bool:
        created = self.index.register(ns.id, fp.hex(), entry)
        self._count(chunks_pushed=int(created))
        return created

    @staticmethod
    def _attempt(fn: Any, arg: Any) -> Any:
        try:
            return fn(arg)
        except (KVCloudError, OSError) as exc:
            return exc

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
            entries = self.index.lookup_run(ns.id, _hex(fps), counters=pending)
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
                return f"corrupt:{type(exc).__name__}", 0
            except (StoreError, OSError) as exc:
                log.warning("store get %s failed: %s", key, exc)
                return "unavailable", 0

        n = len(m.chunks)
        if n == 0:
            return 0, [], 0
        outcomes = [fetch(0)] if n == 1 else list(self.store.executor.map(fetch, range(n)))
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
                except KVCloudError as exc:
                    log.warning("could not drop bad entry %s: %s", ref.fp.hex()[:16], exc)
        self._count(
            chunks_pulled=n_ok,
            bytes_pulled=nbytes,
            tokens_restored=n_ok * ns.chunk_tokens,
            missing_objects=sum(1 for r, _ in outcomes if r == "missing"),
            verify_failures=sum(1 for r, _ in outcomes if r.startswith("corrupt")),
            store_errors=sum(1 for r, _ in outcomes if r == "unavailable"),
            entries_dropped=dropped,
        )
        return n_ok, failures, nbytes

    # -- sessions ---------------------------------------------------------------------------

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
