"""``verify`` and ``gc``: check that the index and the store agree, and reclaim space.

Both are plain functions over an ObjectStore and an Index so they can run from Python, from
the CLI (``kvcloud verify`` / ``kvcloud gc``, thin wrappers) or from tests. What they must
respect (DESIGN §4):

- invariant 1, *object before entry*: an entry must never name a missing object. ``verify``
  checks exactly that (and, with ``deep``, that the object is the right one);
- invariant 4, *the index is a hint*: an entry whose object is gone is a miss, so ``verify
  --repair`` may drop bad entries and ``gc`` may drop entries to free space;
- invariant 6, *deletes go entry-first*: ``gc`` drops entries before deleting objects, and
  deletes only objects that are unreferenced by every entry and session record AND older
  than a grace period, so a push that has written its object but not yet its entry survives.

Session ids are credentials (anyone holding one can continue the conversation on a worker),
so reports show only a short prefix of them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice, pairwise
from typing import Any, TypeVar

from .errors import ConfigError, CorruptObjectError, KVCloudError, ObjectNotFoundError
from .indexes.base import EntryRecord, Index
from .segment import (
    MAX_UNBOUND_RAW_LEN,
    SegmentHeader,
    decode_segment,
    digest_from_key,
    digest_matches,
    part_record_fp,
    read_header,
)
from .sessions import SessionRecord, unpack_record
from .stores.base import ObjectInfo, ObjectStore

#: ``progress(phase, advance, total)``: ``advance`` more items of ``phase`` are done;
#: ``total`` is the phase's size when known (else None). Called from the caller's thread.
ProgressFn = Callable[[str, int, int | None], None]

# Object keys as the client writes them: <ns id (16 bytes hex)>/<d[:2]>/<d>, d = BLAKE3-256
# hex + ".b3l" (format v3, the header's digest) or ".b3" (v2, the whole object's), or bare
# SHA-256 hex (format v1, still read).
# gc deletes nothing else: a bucket prefix shared with other data, or a future key scheme,
# must never be collected by a gc that does not understand it.
_KEY_RE = re.compile(r"^(?P<ns>[0-9a-f]{32})/(?P<d2>[0-9a-f]{2})/(?P<d>[0-9a-f]{64}(\.b3l?)?)$")

_BATCH = 256  # keys per parallel round of HEAD/GET/DELETE
DEFAULT_GRACE_SECONDS = 3600
#: gc's last look for entries registered for an object it deleted (see gc's comment)
MAX_SETTLE_SECONDS = 15.0
#: problems (and deleted keys) listed in a report; the counts are always complete
MAX_LISTED = 1000

T = TypeVar("T")


def is_object_key(key: str) -> bool:
    """True for keys shaped like the client's ``<ns>/<d[:2]>/<d>``."""
    m = _KEY_RE.match(key)
    return m is not None and m.group("d").startswith(m.group("d2"))


def _key_ns(key: str) -> str | None:
    m = _KEY_RE.match(key)
    return m.group("ns") if m else None


def _batched(items: Iterable[T], n: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _redact_session(session_id: str) -> str:
    return session_id if len(session_id) <= 12 else session_id[:12] + "…"


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


# --- object checks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _ObjectCheck:
    """What the store says about one key (shared by every entry and session naming it)."""

    present: bool
    size: int | None = None
    header: SegmentHeader | None = None  # deep checks only
    error: str | None = None  # deep: why the bytes are not a valid object for this key


def _deep_check(store: ObjectStore, key: str) -> _ObjectCheck:
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        return _ObjectCheck(present=False)
    size = len(data)
    try:
        if not digest_matches(data, digest_from_key(key)):
            return _ObjectCheck(True, size, error="digest mismatch: bytes differ from the key")
        header, _ = read_header(data)
        encrypted = header.encryption.get("alg", "none") != "none"
        if not encrypted and header.raw_len <= MAX_UNBOUND_RAW_LEN:
            # full decode (decompression included); already hashed above, so no digest here.
            # Encrypted payloads need the tenant's key, which verify does not hold: for them
            # the digest (bytes = what was stored) and the header are what can be checked.
            decode_segment(data)
        if header.ns != _key_ns(key):
            return _ObjectCheck(True, size, header, f"header namespace {header.ns} != key's")
        return _ObjectCheck(True, size, header)
    except CorruptObjectError as exc:
        return _ObjectCheck(True, size, error=f"{type(exc).__name__}: {exc}")


def _check_objects(
    store: ObjectStore,
    keys: Sequence[str],
    deep: bool,
    listed: dict[str, ObjectInfo],
) -> dict[str, _ObjectCheck]:
    """Check distinct keys in parallel. Shallow checks trust the listing taken at the start
    (one LIST call per thousand objects instead of a HEAD per entry) and HEAD only keys it
    does not hold, i.e. objects written since."""
    out: dict[str, _ObjectCheck] = {}
    todo: list[str] = []
    for key in keys:
        info = listed.get(key)
        if not deep and info is not None:
            out[key] = _ObjectCheck(True, info.size)
        else:
            todo.append(key)
    if not todo:
        return out

    def one(key: str) -> _ObjectCheck:
        if deep:
            return _deep_check(store, key)
        info = store.head(key)
        return _ObjectCheck(False) if info is None else _ObjectCheck(True, info.size)

    results = [one(todo[0])] if len(todo) == 1 else list(store.executor.map(one, todo))
    out.update(zip(todo, results, strict=True))
    return out


def _list_objects(
    store: ObjectStore, progress: ProgressFn | None, phase: str = "listing objects"
) -> tuple[dict[str, ObjectInfo], int, int]:
    """kvcloud-shaped objects by key, plus the count and bytes of anything else."""
    objects: dict[str, ObjectInfo] = {}
    foreign = foreign_bytes = 0
    for n, info in enumerate(store.list(), 1):
        if is_object_key(info.key):
            objects[info.key] = info
        else:
            foreign += 1
            foreign_bytes += info.size
        if progress and n % 1000 == 0:
            progress(phase, 1000, None)
    if progress:
        progress(phase, (len(objects) + foreign) % 1000, None)
    return objects, foreign, foreign_bytes


def _read_sessions(
    index: Index,
) -> tuple[list[tuple[str, str, SessionRecord]], list[tuple[str, str, str]]]:
    """Parsed records, and (scope, session id, error) for records that do not parse."""
    good: list[tuple[str, str, SessionRecord]] = []
    bad: list[tuple[str, str, str]] = []
    for scope, sid, raw in index.iter_sessions():
        try:
            good.append((scope, sid, unpack_record(sid, raw)))
        except CorruptObjectError as exc:
            bad.append((scope, sid, str(exc)))
    return good, bad


# --- verify ----------------------------------------------------------------------------------


@dataclass
class Problem:
    """One thing verify found wrong. ``kind`` is missing, wrong_size, corrupt (entries) or
    session_missing_object, session_corrupt_object, session_unreadable (session records)."""

    kind: str
    object_key: str | None
    detail: str
    ns: str | None = None
    fp: str | None = None
    session: str | None = None  # "<scope[:8]>/<session id prefix>…"; ids are credentials


@dataclass
class VerifyReport:
    deep: bool = False
    repair: bool = False
    entries_checked: int = 0
    entries_ok: int = 0
    missing: int = 0
    wrong_size: int = 0
    corrupt: int = 0
    sessions_checked: int = 0
    sessions_ok: int = 0
    sessions_broken: int = 0  # unreadable ones included
    sessions_unreadable: int = 0
    objects: int = 0  # kvcloud objects in the store (listing at the start)
    object_bytes: int = 0
    referenced_objects: int = 0
    orphans: int = 0  # objects no entry or session names: reclaimable by gc, not a problem
    orphan_bytes: int = 0
    foreign_objects: int = 0  # keys not shaped like a kvcloud object: never touched
    entries_dropped: int = 0  # --repair
    objects_deleted: int = 0  # --repair --deep: objects whose bytes fail their own digest
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """No entry or session record names a missing, wrong or corrupt object."""
        return not (self.missing or self.wrong_size or self.corrupt or self.sessions_broken)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clean"] = self.clean
        return d


def verify(
    store: ObjectStore,
    index: Index,
    deep: bool = False,
    repair: bool = False,
    progress: ProgressFn | None = None,
) -> VerifyReport:
    """Check every index entry and session record against the store.

    Shallow: each entry's object exists with the entry's size. ``deep``: every referenced
    object is downloaded, hashed (digest = key) and decoded, and its header compared with the
    entry (namespace, fingerprint, token count) or the session (namespace, parent chain,
    token count). Orphans (objects nothing names) are counted, not reported as problems.

    ``repair`` drops every bad entry (compare-and-drop on its object key, so an entry
    re-registered meanwhile for another object survives) and, with ``deep``, deletes objects
    whose bytes fail their own digest twice in a row: a create-only put can never overwrite
    them, so every future push of that content would otherwise reuse the bad bytes. Session
    records are never deleted: a record is the only copy of its conversation's token history,
    and a missing object only costs a recompute when the session resumes.

    Raises KVCloudError (StoreError, IndexBackendError) when a backend fails.
    """
    t0 = time.monotonic()
    r = VerifyReport(deep=deep, repair=repair)
    # Listing first, entries after: an object written and registered while verify runs is
    # then either listed or HEADed, never taken for missing, and never counted as an orphan.
    listed, r.foreign_objects, _ = _list_objects(store, progress)
    r.objects = len(listed)
    r.object_bytes = sum(i.size for i in listed.values())
    checks: dict[str, _ObjectCheck] = {}
    referenced: set[str] = set()
    bad_entries: list[tuple[EntryRecord, Problem]] = []
    seen: set[tuple[str, str]] = set()

    def add_problem(p: Problem) -> None:
        r.problems.append(p)

    for batch in _batched(index.iter_entries(), _BATCH):
        fresh: list[EntryRecord] = []
        for rec in batch:
            if (rec.ns, rec.fp) not in seen:  # Redis SCAN may return a key twice
                seen.add((rec.ns, rec.fp))
                fresh.append(rec)
        keys = sorted(
            {
                key
                for rec in fresh
                for key in rec.entry.keys
                if is_object_key(key) and key not in checks
            }
        )
        checks.update(_check_objects(store, keys, deep, listed))
        for rec in fresh:
            referenced.update(rec.entry.keys)
            r.entries_checked += 1
            problem = _entry_problem(rec, checks, deep)
            if problem is None:
                r.entries_ok += 1
                continue
            if problem.kind == "missing":
                r.missing += 1
            elif problem.kind == "wrong_size":
                r.wrong_size += 1
            else:
                r.corrupt += 1
            add_problem(problem)
            bad_entries.append((rec, problem))
        if progress:
            progress("checking entries", len(batch), None)

    # Sessions: every object a record names must exist (deep: and be the right object).
    records, unreadable = _read_sessions(index)
    for scope, sid, err in unreadable:
        r.sessions_checked += 1
        r.sessions_broken += 1
        r.sessions_unreadable += 1
        add_problem(
            Problem("session_unreadable", None, err, session=f"{scope[:8]}/{_redact_session(sid)}")
        )
    for batch in _batched(records, _BATCH):
        keys = sorted(
            {
                k
                for _, _, rec in batch
                for k in rec.object_keys
                if is_object_key(k) and k not in checks
            }
        )
        checks.update(_check_objects(store, keys, deep, listed))
        for scope, sid, rec in batch:
            r.sessions_checked += 1
            referenced.update(rec.object_keys)
            label = f"{scope[:8]}/{_redact_session(sid)}"
            problems = _session_problems(rec, checks, deep, label)
            if problems:
                r.sessions_broken += 1
                for p in problems:
                    add_problem(p)
            else:
                r.sessions_ok += 1
        if progress:
            progress("checking sessions", len(batch), None)

    orphans = [info for key, info in listed.items() if key not in referenced]
    r.referenced_objects = len(referenced)
    r.orphans = len(orphans)
    r.orphan_bytes = sum(i.size for i in orphans)

    if repair:
        _repair(store, index, r, bad_entries, checks, progress)
    r.seconds = round(time.monotonic() - t0, 3)
    return r


def _entry_problem(rec: EntryRecord, checks: dict[str, _ObjectCheck], deep: bool) -> Problem | None:
    """What is wrong with an entry: its object (or any of its parts) missing, of another
    size than the entry says (the parts' sizes summed), or, deep, not the object named."""
    e = rec.entry
    keys = e.keys
    # where each key sits: its pipeline stage's layers, its place among the stage's parts
    places = [(layers, j, len(ks)) for layers, ks in e.stages for j in range(len(ks))]
    total = 0
    for key, (layers, j, n_parts) in zip(keys, places, strict=True):

        def problem(kind: str, detail: str, key: str = key) -> Problem:
            return Problem(kind, key, detail, ns=rec.ns, fp=rec.fp)

        check = checks.get(key)
        if check is None:  # not a kvcloud key: nothing could ever be pulled from it
            return problem("corrupt", "entry names a malformed object key")
        if _key_ns(key) != rec.ns:
            return problem(
                "corrupt", f"object key is in namespace {_key_ns(key)}, entry in {rec.ns}"
            )
        if not check.present:
            return problem("missing", "object not found")
        total += check.size
        if len(keys) == 1 and check.size != e.size:
            return problem("wrong_size", f"object is {check.size} bytes, entry says {e.size}")
        if deep:
            if check.error is not None:
                return problem("corrupt", check.error)
            h = check.header
            assert h is not None
            # a part's record (KVCloud.offer_part) sits under a fingerprint derived from its
            # chunk's and its head range
            record = (h.heads is not None or h.layers is not None) and part_record_fp(
                h.fp, h.heads or (0, h.layout[1]), h.layers
            ).hex() == rec.fp
            if h.fp.hex() != rec.fp and not record:
                return problem("corrupt", f"header fingerprint {h.fp.hex()[:16]}… != entry's")
            if h.n_tokens != e.n_tokens:
                return problem("corrupt", f"header holds {h.n_tokens} tokens, entry {e.n_tokens}")
            if record:
                continue
            if h.layers != layers:
                return problem(
                    "corrupt", f"part holds layers {h.layers}, the entry's stage is {layers}"
                )
            if n_parts > 1:
                heads = h.layout[1] * n_parts  # equal parts of the chunk's heads
                want = (j * heads // n_parts, (j + 1) * heads // n_parts)
                if h.heads != want:
                    return problem(
                        "corrupt", f"part {j} holds KV heads {h.heads}, the entry's is {want}"
                    )
            elif h.heads is not None:
                return problem("corrupt", f"entry names one part (KV heads {h.heads}) as whole")
    if total != e.size:
        detail = f"{len(keys)} parts hold {total} bytes, entry says {e.size}"
        return Problem("wrong_size", e.object_key, detail, ns=rec.ns, fp=rec.fp)
    return None


def _session_problems(
    rec: SessionRecord, checks: dict[str, _ObjectCheck], deep: bool, label: str
) -> list[Problem]:
    out: list[Problem] = []

    def problem(kind: str, key: str | None, detail: str) -> None:
        out.append(Problem(kind, key, detail, ns=rec.ns, session=label))

    headers: list[SegmentHeader] = []
    for key in rec.object_keys:
        check = checks.get(key)
        if check is None or _key_ns(key) != rec.ns:
            problem("session_corrupt_object", key, "record names a malformed or foreign key")
        elif not check.present:
            problem("session_missing_object", key, "object not found")
        elif deep and check.error is not None:
            problem("session_corrupt_object", key, check.error)
        elif deep and check.header is not None and (check.header.heads or (0,))[0] == 0:
            # a chunk stored in parts counts once in the chain: by its first part
            headers.append(check.header)
    if deep and not out and headers:
        # the record's objects must form one fingerprint chain covering its KV tokens
        for prev, cur in pairwise(headers):
            if cur.parent != prev.fp:
                problem("session_corrupt_object", None, "objects do not form one prefix chain")
                break
        total = sum(h.n_tokens for h in headers)
        if not out and total != rec.kv_tokens:
            problem(
                "session_corrupt_object",
                None,
                f"objects hold {total} tokens, record says {rec.kv_tokens}",
            )
    return out


def _repair(
    store: ObjectStore,
    index: Index,
    r: VerifyReport,
    bad: list[tuple[EntryRecord, Problem]],
    checks: dict[str, _ObjectCheck],
    progress: ProgressFn | None,
) -> None:
    for rec, problem in bad:
        key = rec.entry.object_key
        if not r.deep and problem.kind in ("missing", "wrong_size"):
            # the shallow verdict may come from the listing taken at the start: look again
            # so an entry whose object was (re)written since is not dropped for nothing
            infos = [store.head(k) for k in rec.entry.keys]
            if all(infos) and sum(i.size for i in infos if i) == rec.entry.size:
                continue
        # compare-and-drop: an entry re-registered meanwhile for another object survives
        if index.drop(rec.ns, rec.fp, key):
            r.entries_dropped += 1
        if progress:
            progress("dropping bad entries", 1, len(bad))
    if not r.deep:
        return
    # Objects whose bytes fail their own digest can never become valid (puts are
    # create-only, so a correct re-push would keep reusing them): delete them after their
    # entries are gone (entry-first), once a second read confirms the first.
    for key, check in checks.items():
        if check.present and check.error and check.error.startswith("digest mismatch"):
            again = _deep_check(store, key)
            if again.present and again.error and again.error.startswith("digest mismatch"):
                store.delete(key)
                r.objects_deleted += 1


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
    listed, r.foreign_objects, _ = _list_objects(store, progress)
    r.objects = len(listed)
    r.object_bytes = sum(i.size for i in listed.values())

    def size_of(key: str) -> int:
        info = listed.get(key)
        return info.size if info is not None else 0

    records, unreadable = _read_sessions(index)
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
    later_records, later_unreadable = _read_sessions(index)
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
    for batch in _batched(candidates, _BATCH):
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
        records, _ = _read_sessions(index)
    except KVCloudError:
        return  # only a statistic; the deletes are done
    r.sessions_damaged = sum(
        1 for _, _, rec in records if any(k in deleted and still_gone(k) for k in rec.object_keys)
    )


__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "GcReport",
    "Problem",
    "ProgressFn",
    "VerifyReport",
    "gc",
    "is_object_key",
    "parse_duration",
    "parse_size",
    "verify",
]
