"""Parts: a chunk stored as several objects, one per tensor-parallel rank's KV heads and
pipeline stage's layers, and registered once every part is in.

No coordinator: each writer stores its part, records it in the index, and the writer that
sees every part recorded registers the chunk. Until then the chunk is a miss (invariant 1: no
entry before its objects).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

from ..errors import LayoutError
from ..indexes.base import IndexEntry
from ..namespace import Namespace
from ..segment import encode_segment_parts, part_record_fp
from .push import PushMixin


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


class PartsMixin(PushMixin):
    """KVCloud's calls for a chunk stored in parts."""

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
        chunk once every part is in. Until then the chunk is a miss (invariant 1: no entry
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
        expires one TTL after it was written (reading it here does not renew it). True if
        this call registered the chunk."""
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
        # Reading the siblings' records must not renew them: a grid some rank never completes
        # (its part dropped on a full queue, its rank gone) would otherwise live on while
        # the prefix stays hot, each writer keeping the others' records alive, and its
        # parts would never reach gc. A record lives one TTL from its write.
        found = self.index.lookup(
            ns.id,
            [part_record_fp(fp, h, stage).hex() for stage, hs in grid for h in hs],
            renew=False,
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
