"""The index interface. Every backend implements it and passes tests/contracts."""

from __future__ import annotations

import itertools
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

from .._closing import Closing

DEFAULT_TTL_SECONDS = 7 * 24 * 3600


# separates the keys of a chunk stored in parts (no object key contains it)
PART_SEP = ","
# the last element of a grid entry's key list: the pipeline stages' layer boundaries, as
# ``@stages=0-2-4`` (layers [0, 2) and [2, 4)); the keys before it are the parts, stage by
# stage, each stage's in head order. Last and shaped like no key, so a release that does not
# know grids still sees every part's key (its gc keeps them) and misses on the marker.
STAGES_MARK = "@stages="
_STAGES = re.compile(r"@stages=(\d+(?:-\d+)+)")

Stage = tuple[tuple[int, int] | None, tuple[str, ...]]


def parse_stages(object_key: str) -> tuple[Stage, ...]:
    """The parts an entry's object key names, by pipeline stage: ``(layers, keys)`` with
    layers [lo, hi) and the stage's keys in head order; one stage of every layer (``None``)
    for a chunk stored whole or in head parts only. A key list whose marker does not parse,
    or whose keys do not split evenly over its stages, is read as a plain key list (the
    marker then names no object: a miss), never an error."""
    keys = object_key.split(PART_SEP)
    m = _STAGES.fullmatch(keys[-1]) if len(keys) > 1 else None
    if m is None:
        return ((None, tuple(keys)),)
    bounds = [int(b) for b in m[1].split("-")]
    parts, n = keys[:-1], len(bounds) - 1
    if len(parts) % n:
        return ((None, tuple(keys)),)
    w = len(parts) // n
    return tuple(((bounds[s], bounds[s + 1]), tuple(parts[s * w : (s + 1) * w])) for s in range(n))


def object_keys_of(object_key: str) -> tuple[str, ...]:
    """Every object an entry's (or a session record's chunk) key names."""
    return tuple(k for _, keys in parse_stages(object_key) for k in keys)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """What the index knows about one (namespace, fingerprint).

    A chunk stored whole names one object. A chunk stored in parts (by an engine that shards
    its KV heads over tensor-parallel ranks, each rank writing the heads it holds) names every
    part, in head order, joined by ``PART_SEP``: part j of P holds KV heads
    [j·H/P, (j+1)·H/P) of the namespace's H. The entry is registered once every part is
    stored, so a lookup still answers in one round trip with everything a pull needs.

    A chunk saved by a pipeline-parallel engine (each stage holding a range of layers) is a
    grid: per stage its layer range and its parts in head order (``of_grid``, ``stages``).
    """

    object_key: str  # store-relative key of the segment object (or the parts' keys)
    n_tokens: int
    size: int  # bytes of the stored object (of every part, summed)
    created: float  # unix seconds when first registered

    @property
    def keys(self) -> tuple[str, ...]:
        """The objects this entry names: one, or a chunk's parts (stage by stage, each in
        head order)."""
        return object_keys_of(self.object_key)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return parse_stages(self.object_key)

    @classmethod
    def of_parts(cls, keys: Sequence[str], n_tokens: int, size: int, created: float) -> IndexEntry:
        return cls(_join_keys(keys), n_tokens, size, created)

    @classmethod
    def of_grid(
        cls,
        stages: Sequence[tuple[tuple[int, int], Sequence[str]]],
        n_tokens: int,
        size: int,
        created: float,
    ) -> IndexEntry:
        """A chunk stored by pipeline stages: ``(layers, keys)`` per stage, in layer order."""
        if len(stages) == 1:
            return cls.of_parts(stages[0][1], n_tokens, size, created)
        if len({len(keys) for _, keys in stages}) != 1 or any(
            a[0][1] != b[0][0] for a, b in itertools.pairwise(stages)
        ):
            raise ValueError("stages must be adjacent layer ranges with as many parts each")
        mark = STAGES_MARK + "-".join(str(b) for b in [stages[0][0][0], *(s[0][1] for s in stages)])
        keys = [k for _, ks in stages for k in ks]
        return cls(f"{_join_keys(keys)}{PART_SEP}{mark}", n_tokens, size, created)

    def pack(self) -> bytes:
        return msgpack.packb([self.object_key, self.n_tokens, self.size, self.created])

    @classmethod
    def unpack(cls, raw: bytes) -> IndexEntry:
        key, n, size, created = msgpack.unpackb(raw)
        return cls(object_key=key, n_tokens=int(n), size=int(size), created=float(created))


@dataclass(frozen=True)
class EntryRecord:
    """An entry as listed by ``iter_entries`` (for stats, ls, verify and gc)."""

    ns: str
    fp: str  # hex
    entry: IndexEntry
    expires_at: float | None  # unix seconds, None if it never expires


@dataclass(frozen=True)
class NamespaceTotals:
    """The live entries of one namespace, the bytes of the objects they name and the tokens
    they cover."""

    entries: int
    bytes: int
    tokens: int


@dataclass
class IndexSummary:
    """Index-wide figures for monitoring (``Index.summary``)."""

    namespaces: dict[str, NamespaceTotals]  # only namespaces with live entries
    sessions: int
    sessions_exact: bool  # False: estimated (a Redis keyspace too large to count, sampled)
    counters: dict[str, int]
    sample: list[EntryRecord]  # live entries drawn at random, at most sample_size per ns
    # when each namespace's bookkeeping began (Redis; figures complete one TTL later)
    since: dict[str, float] = field(default_factory=dict)


def _join_keys(keys: Sequence[str]) -> str:
    if not keys or any(not k or PART_SEP in k or k.startswith(STAGES_MARK) for k in keys):
        raise ValueError(f"part keys must be non-empty and free of {PART_SEP!r}")
    return PART_SEP.join(keys)


def leading_run(found: Sequence[IndexEntry | None]) -> list[IndexEntry]:
    """The entries before the first miss."""
    run = next((i for i, e in enumerate(found) if e is None), len(found))
    return list(found[:run])  # type: ignore[arg-type]


class Index(Closing, ABC):
    """Prefix-fingerprint → object-key entries, session records and counters.

    ``ns`` is a namespace id and ``fp`` a fingerprint in hex. Entries expire ``ttl`` seconds
    after their last hit (sliding). Implementations must be thread-safe.
    """

    #: URL with any password removed, safe to log and print
    url: str = ""

    def __init__(self, ttl_seconds: int = DEFAULT_TTL_SECONDS) -> None:
        self.ttl_seconds = int(ttl_seconds)

    def renewal_due(self, now: float) -> float:
        """Hits whose expiry is earlier than this get their TTL renewed: a hundredth of the
        TTL (at most a minute) short of a fresh one, so a hot prefix costs an index write a
        minute rather than one per lookup (and gc's LRU order has that resolution)."""
        return now + self.ttl_seconds - min(self.ttl_seconds / 100, 60.0)

    @abstractmethod
    def register(self, ns: str, fp: str, entry: IndexEntry) -> bool:
        """Create the entry unless one exists (SET NX). True if created now.

        Call only after the object is durably stored (invariant 1).
        """

    def register_many(self, ns: str, entries: Sequence[tuple[str, IndexEntry]]) -> list[bool]:
        """Register several (fp, entry) pairs with SET NX semantics each; backends do it in
        one round trip. Call only after every object is durably stored (invariant 1)."""
        return [self.register(ns, fp, entry) for fp, entry in entries]

    @abstractmethod
    def lookup(
        self,
        ns: str,
        fps: Sequence[str],
        counters: Mapping[str, int] | None = None,
        *,
        renew: bool = True,
    ) -> list[IndexEntry | None]:
        """Entries for every fp, in order, in ONE round trip; hits get their TTL renewed
        unless ``renew`` is False (a read that must not keep what it reads alive: a writer
        checking its siblings' part records).

        ``counters`` are increments applied in the same round trip (so statistics cost no
        extra latency on the request path).
        """

    def lookup_run(
        self, ns: str, fps: Sequence[str], counters: Mapping[str, int] | None = None
    ) -> list[IndexEntry]:
        """The entries of the leading run of hits: ``lookup`` cut at the first miss, which is
        all a restore can use (a chunk needs every chunk before it). Backends may stop
        reading at that miss and return less; the request path of ``KVCloud.lookup``."""
        return leading_run(self.lookup(ns, fps, counters))

    @abstractmethod
    def drop(self, ns: str, fp: str, object_key: str | None = None) -> bool:
        """Delete the entry (only if it still points at ``object_key``, when given)."""

    @abstractmethod
    def iter_entries(self, ns: str | None = None) -> Iterator[EntryRecord]:
        """Every live entry (optionally of one namespace), in no particular order."""

    # -- sessions ---------------------------------------------------------------------------

    @abstractmethod
    def put_session(
        self, scope: str, session_id: str, record: bytes, ttl_seconds: int | None = None
    ) -> None:
        """Write (replace) a session record. ``scope`` isolates tenants."""

    @abstractmethod
    def get_session(self, scope: str, session_id: str) -> bytes | None:
        """The record, or None."""

    @abstractmethod
    def delete_session(self, scope: str, session_id: str) -> bool:
        """Remove a record; True if it existed."""

    @abstractmethod
    def iter_sessions(self) -> Iterator[tuple[str, str, bytes]]:
        """Every (scope, session_id, record), for gc reachability."""

    # -- counters and health ----------------------------------------------------------------

    @abstractmethod
    def incr(self, counters: Mapping[str, int]) -> None:
        """Add to named counters (hits, misses, bytes_pulled, ...)."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Current value of every counter."""

    @abstractmethod
    def ping(self) -> float:
        """One round trip; returns its latency in seconds. Raises IndexUnavailableError."""

    def count_entries(self, ns: str | None = None) -> int:
        return sum(1 for _ in self.iter_entries(ns))

    def summary(self, sample_size: int = 512) -> IndexSummary:
        """Live entries, bytes and tokens per namespace, sessions, counters, and at most
        ``sample_size`` live entries per namespace drawn at random: what ``kvcloud stats
        --serve`` reports. Backends answer from their own bookkeeping, at a cost independent
        of their size; none renews a TTL or otherwise marks what it reads as used. This
        default, for a backend without bookkeeping, scans every entry (exact, O(index))."""
        rng = random.Random()
        totals: dict[str, list[int]] = {}
        samples: dict[str, list[EntryRecord]] = {}
        for rec in self.iter_entries():
            t = totals.setdefault(rec.ns, [0, 0, 0])
            t[0] += 1
            t[1] += rec.entry.size
            t[2] += rec.entry.n_tokens
            kept = samples.setdefault(rec.ns, [])
            if len(kept) < sample_size:
                kept.append(rec)
            elif (j := rng.randrange(t[0])) < sample_size:  # reservoir sampling
                kept[j] = rec
        return IndexSummary(
            namespaces={ns: NamespaceTotals(*t) for ns, t in totals.items()},
            sessions=sum(1 for _ in self.iter_sessions()),
            sessions_exact=True,
            counters=self.counters(),
            sample=[rec for kept in samples.values() for rec in kept],
        )

    def close(self) -> None:
        """Release connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
