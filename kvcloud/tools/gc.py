"""``gc``: trim least-recently-used entries to a byte budget and delete old unreferenced objects.

A plain function over an ObjectStore and an Index, so it runs from Python, from the CLI
(``kvcloud gc``, a thin wrapper) or from tests. What it must respect (the invariants in
docs/ARCHITECTURE.md):

- invariant 4, *the index is a hint*: an entry whose object is gone is a miss, so ``gc`` may
  drop entries to free space;
- invariant 6, *deletes go entry-first*: ``gc`` drops entries before deleting objects, and
  deletes only objects that are unreferenced by every entry and session record AND older
  than a grace period, so a push that has written its object but not yet its entry survives.

The command line's ``--grace``, ``--max-bytes`` and ``--settle`` go through
:func:`parse_duration` and :func:`parse_size`, here for Python callers too.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError, KVCloudError
from ..indexes.base import EntryRecord, Index
from ..stores.base import ObjectInfo, ObjectStore
from .inventory import BATCH, ProgressFn, batched, list_objects, read_sessions

DEFAULT_GRACE_SECONDS = 3600
#: gc's last look for entries registered for an object it deleted (see gc's comment)
MAX_SETTLE_SECONDS = 15.0
#: deleted keys listed in a report; the count is always complete
MAX_LISTED = 1000


# --- parsing durations and sizes (CLI and Python callers) ------------------------------------

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i)?)?b?\s*$", re.IGNORECASE)


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``30s``, ``15m``, ``2h``, ``1d``, ``1w``, ``500ms`` or plain seconds."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _DURATION_RE.match(text)
        if not m:
            raise ConfigError(f"bad duration {text!r}; use e.g. 30s, 15m, 2h, 1d or seconds")
        value = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if value < 0:
        raise ConfigError("a duration must not be negative")
    return value


def parse_size(text: str | int) -> int:
    """Bytes from ``500MB``, ``2GiB``, ``10k`` (decimal units, binary with ``i``) or bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        if not m:
            raise ConfigError(f"bad size {text!r}; use e.g. 500MB, 2GiB or a number of bytes")
        base = 1024 if m.group(3) else 1000
        power = " kmgtp".index(m.group(2).lower()) if m.group(2) else 0
        value = int(float(m.group(1)) * base**power)
    if value < 0:
        raise ConfigError("a size must not be negative")
    return value


# --- gc --------------------------------------------------------------------------------------


@dataclass
class GcReport:
    dry_run: bool = False
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    max_bytes: int | None = None
    objects: int = 0  # kvcloud objects listed at the start
    object_bytes: int = 0
    foreign_objects: int = 0  # keys not shaped like kvcloud objects: never deleted
    entries: int = 0  # live index entries seen
    sessions: int = 0
    sessions_unreadable: int = 0  # if any, no object is deleted (their references are unknown)
    # phase (a): --max-bytes
    referenced_bytes_before: int = 0  # bytes of objects entries or sessions name
    entries_dropped: int = 0
    entry_bytes_dropped: int = 0  # bytes of the objects those drops left unreferenced
    referenced_bytes_after: int = 0
    over_budget: bool = False  # still above --max-bytes (sessions alone exceed it)
    # phase (b): unreferenced objects
    referenced_objects: int = 0
    unreferenced: int = 0
    kept_young: int = 0  # unreferenced but inside the grace period (maybe a push in flight)
    kept_young_bytes: int = 0
    kept_touched: int = 0  # old in the listing, freshly written or touched when re-checked
    already_gone: int = 0
    objects_deleted: int = 0  # dry run: would delete
    bytes_freed: int = 0  # dry run: would free
    dangling_dropped: int = 0  # entries registered for an object while it was being deleted
    sessions_damaged: int = 0  # session records written for an object while it was deleted
    skipped: str | None = None  # why object deletion did not run
    seconds: float = 0.0
    deleted_keys: list[str] = field(default_factory=list)  # first MAX_LISTED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    store: ObjectStore,
    index: Index,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    max_bytes: int | None = None,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
    settle_seconds: float | None = None,
) -> GcReport:
    """(a) with ``max_bytes``: drop least-recently-used entries until the objects still
    referenced fit; (b) delete objects referenced by no entry and no session record and
    older than ``grace_seconds``. Entries always go before objects (invariant 6).

    ``max_bytes`` bounds the bytes of referenced objects (named by an entry or a session
    record). Sessions are never trimmed, and an entry whose object a session also names is
    skipped (dropping it would free nothing); if sessions alone exceed the budget,
    ``over_budget`` says so. Objects inside the grace period are kept either way, so the
    store may stay above the budget until a later run.

    ``dry_run`` changes nothing and reports what would be dropped and deleted.
    ``settle_seconds`` (default: the grace period, at most 15 s) is how long after its last
    delete gc looks once more for entries a concurrent push registered for a deleted object
    (see the comment in the body); it only runs when something was deleted.
    Raises KVCloudError when a backend fails; gc is idempotent, so just run it again.
    """
    t0 = time.monotonic()
    grace = float(grace_seconds)
    if grace < 0:
        raise ConfigError("grace must not be negative")
    if max_bytes is not None and max_bytes < 0:
        raise ConfigError("max_bytes must not be negative")
    r = GcReport(dry_run=dry_run, grace_seconds=grace, max_bytes=max_bytes)

    # Why this order, and why it is safe against pushes running concurrently:
    #
    # 1. LIST the store first, then read the references (entries, sessions). A push writes
    #    (or touches) its object at T_w and registers its entry at T_reg > T_w. If T_reg is
    #    before the reference read, the object is referenced and kept. If it is after, the
    #    push was in flight during the read, and its object is young — unless its mtime in
    #    the listing is stale, which happens when the push found the object already stored
    #    (an orphan, maybe old) and touched it after the LIST.
    # 2. So right before deleting a candidate, HEAD it again and keep it if its mtime is
    #    now inside the grace period: a touch or re-write since the LIST shows up here.
    #    Re-reading the whole index before each batch instead would cost a full scan per
    #    batch and still leave a window between that read and the DELETE; the fresh mtime
    #    is what a push leaves behind first, and HEAD+DELETE back to back keep the window
    #    to one round trip.
    # 3. What remains is a push that reuses an old orphan inside that round trip: it
    #    touches the object after our HEAD (or, as the client does not check touch's result,
    #    finds it stored just before our DELETE and touches it in vain just after) and
    #    registers its entry after our reference read, maybe even before our DELETE. No
    #    sequence of reads before a plain DELETE can exclude that (a push can always land
    #    between the last read and the DELETE); a conditional delete in the store, or a
    #    client that HEADs a reused object after registering it and re-puts it if gone,
    #    would. So gc repairs it: after deleting, it reads the index again and
    #    compare-and-drops every entry naming a deleted key that is still gone, right away
    #    and once more ``settle_seconds`` later (such a push registers within one
    #    put→register time of our DELETE, the bound the grace period already assumes). In
    #    between, the entry is a miss for one chunk (invariant 4), never wrong data. Session
    #    records written in that window are counted in ``sessions_damaged`` (the session
    #    resumes by recomputing the chunk).
    #
    # The grace period must exceed the longest put→register time of a push (and any clock
    # skew between this host and the store, whose mtimes we compare with our clock; S3's
    # Last-Modified is truncated to the second, so an object can look up to 1 s older).
    listed, r.foreign_objects, _ = list_objects(store, progress)
    r.objects = len(listed)
    r.object_bytes = sum(i.size for i in listed.values())

    def size_of(key: str) -> int:
        info = listed.get(key)
        return info.size if info is not None else 0

    records, unreadable = read_sessions(index)
    r.sessions = len(records) + len(unreadable)
    r.sessions_unreadable = len(unreadable)
    session_keys: set[str] = {k for _, _, rec in records for k in rec.object_keys}

    # --- (a) trim least-recently-used entries to fit max_bytes -----------------------------
    simulated_drops: set[tuple[str, str, str]] = set()  # dry run: what (a) would drop
    if max_bytes is not None:
        entries: dict[tuple[str, str], EntryRecord] = {}
        for rec in index.iter_entries():
            entries[(rec.ns, rec.fp)] = rec
        refcount: dict[str, int] = {}
        for rec in entries.values():
            for k in rec.entry.keys:
                refcount[k] = refcount.get(k, 0) + 1
        referenced = set(refcount) | session_keys
        # Bytes as listed: an entry whose object is not in the listing (gone, or written
        # since) frees nothing that this run could measure or delete.
        total = sum(size_of(k) for k in referenced)
        r.referenced_bytes_before = total
        # expires_at = last hit + ttl (sliding), so ascending expires_at = least recently
        # used first; entries that never expire fall back to their creation time
        order = sorted(
            entries.values(),
            key=lambda e: (
                e.expires_at if e.expires_at is not None else e.entry.created,
                e.entry.created,
            ),
        )
        for rec in order:
            if total <= max_bytes:
                break
            key = rec.entry.object_key
            if any(k in session_keys for k in rec.entry.keys):
                continue  # a session still needs the object: dropping frees nothing
            if dry_run:
                simulated_drops.add((rec.ns, rec.fp, key))
                dropped = True
            else:
                dropped = index.drop(rec.ns, rec.fp, key)  # compare-and-drop
            if not dropped:
                continue  # gone or replaced meanwhile; the reference read below sees it
            r.entries_dropped += 1
            for k in rec.entry.keys:  # a chunk's parts go with it
                refcount[k] -= 1
                if refcount[k] == 0:
                    freed = size_of(k)
                    total -= freed
                    r.entry_bytes_dropped += freed
            if progress:
                progress("dropping least-recently-used entries", 1, None)
        r.referenced_bytes_after = total
        r.over_budget = total > max_bytes

    # --- (b) delete unreferenced objects older than the grace period ------------------------
    # References are read AFTER the listing and after (a): see the comment above.
    referenced_now: set[str] = set(session_keys)
    n_entries = 0
    for rec in index.iter_entries():
        n_entries += 1
        if (rec.ns, rec.fp, rec.entry.object_key) not in simulated_drops:
            referenced_now.update(rec.entry.keys)
        if progress and n_entries % 1000 == 0:
            progress("reading index entries", 1000, None)
    # sessions written since the first read are references too
    later_records, later_unreadable = read_sessions(index)
    referenced_now.update(k for _, _, rec in later_records for k in rec.object_keys)
    r.entries = n_entries
    r.referenced_objects = len(referenced_now & listed.keys())
    if max_bytes is None:
        r.referenced_bytes_before = r.referenced_bytes_after = sum(
            size_of(k) for k in referenced_now
        )
    if unreadable or later_unreadable:
        # a record we cannot parse (corrupt, or written by a newer version) may name any
        # object; deleting without knowing would break that session
        r.skipped = "unreadable session records (see `kvcloud verify`); no object deleted"
        r.seconds = round(time.monotonic() - t0, 3)
        return r

    cutoff = time.time() - grace
    candidates: list[ObjectInfo] = []
    for key, info in listed.items():
        if key in referenced_now:
            continue
        r.unreferenced += 1
        if info.last_modified >= cutoff:
            r.kept_young += 1
            r.kept_young_bytes += info.size
        else:
            candidates.append(info)

    def check_and_delete(info: ObjectInfo) -> tuple[str, ObjectInfo | None]:
        # a fresh mtime right before deleting (step 2 above), and the DELETE right after
        # it in the same task: the window a concurrent push can slip into is one round trip
        fresh = store.head(info.key)
        if fresh is None:
            return "gone", None
        if fresh.last_modified >= time.time() - grace:
            return "touched", fresh
        if not dry_run:
            store.delete(info.key)
        return "deleted", fresh

    deleted: set[str] = set()
    for batch in batched(candidates, BATCH):
        outcomes = (
            [check_and_delete(batch[0])]
            if len(batch) == 1
            else list(store.executor.map(check_and_delete, batch))
        )
        for outcome, info in outcomes:
            if outcome == "gone":
                r.already_gone += 1
            elif outcome == "touched":
                r.kept_touched += 1
            else:
                assert info is not None
                deleted.add(info.key)
                r.objects_deleted += 1
                r.bytes_freed += info.size
                if len(r.deleted_keys) < MAX_LISTED:
                    r.deleted_keys.append(info.key)
        if progress:
            progress("deleting unreferenced objects", len(batch), len(candidates))

    if deleted and not dry_run:
        settle = min(grace, MAX_SETTLE_SECONDS) if settle_seconds is None else settle_seconds
        settled_at = time.monotonic() + max(0.0, settle)
        _sweep_dangling(store, index, deleted, r)
        if settle > 0:
            if progress:
                progress(f"waiting {settle:.0f} s for pushes in flight", 0, None)
            time.sleep(max(0.0, settled_at - time.monotonic()))
            _sweep_dangling(store, index, deleted, r)
    r.seconds = round(time.monotonic() - t0, 3)
    return r


def _sweep_dangling(store: ObjectStore, index: Index, deleted: set[str], r: GcReport) -> None:
    """Step 3 of gc's race handling: entries registered for an object while gc was deleting
    it would name nothing; drop them (compare-and-drop) so they are misses no more."""
    gone: dict[str, bool] = {}

    def still_gone(key: str) -> bool:
        # a push may have written the object again since (same content, same key): its
        # entry is valid then and stays
        if key not in gone:
            gone[key] = store.head(key) is None
        return gone[key]

    for rec in index.iter_entries():
        key = rec.entry.object_key
        parts = rec.entry.keys
        if any(k in deleted and still_gone(k) for k in parts) and index.drop(rec.ns, rec.fp, key):
            r.dangling_dropped += 1
    try:
        records, _ = read_sessions(index)
    except KVCloudError:
        return  # only a statistic; the deletes are done
    r.sessions_damaged = sum(
        1 for _, _, rec in records if any(k in deleted and still_gone(k) for k in rec.object_keys)
    )


__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "GcReport",
    "gc",
    "parse_duration",
    "parse_size",
]
