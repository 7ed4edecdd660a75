"""``verify``: check that every index entry and session record names a present, right object.

A plain function over an ObjectStore and an Index, so it runs from Python, from the CLI
(``kvcloud verify``, a thin wrapper) or from tests. What it checks and may repair (the
invariants in docs/ARCHITECTURE.md):

- invariant 1, *object before entry*: an entry must never name a missing object. ``verify``
  checks exactly that (and, with ``deep``, that the object is the right one);
- invariant 4, *the index is a hint*: an entry whose object is gone is a miss, so ``verify
  --repair`` may drop bad entries.

Session ids are credentials (anyone holding one can continue the conversation on a worker),
so reports show only a short prefix of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

from ..errors import CorruptObjectError, ObjectNotFoundError
from ..indexes.base import EntryRecord, Index
from ..segment import (
    MAX_UNBOUND_RAW_LEN,
    SegmentHeader,
    decode_segment,
    digest_from_key,
    digest_matches,
    part_record_fp,
    read_header,
)
from ..sessions import SessionRecord
from ..stores.base import ObjectInfo, ObjectStore
from .inventory import (
    BATCH,
    ProgressFn,
    batched,
    is_object_key,
    key_ns,
    list_objects,
    read_sessions,
)


def _redact_session(session_id: str) -> str:
    return session_id if len(session_id) <= 12 else session_id[:12] + "…"


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
        if header.ns != key_ns(key):
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
    listed, r.foreign_objects, _ = list_objects(store, progress)
    r.objects = len(listed)
    r.object_bytes = sum(i.size for i in listed.values())
    checks: dict[str, _ObjectCheck] = {}
    referenced: set[str] = set()
    bad_entries: list[tuple[EntryRecord, Problem]] = []
    seen: set[tuple[str, str]] = set()

    def add_problem(p: Problem) -> None:
        r.problems.append(p)

    for batch in batched(index.iter_entries(), BATCH):
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
    records, unreadable = read_sessions(index)
    for scope, sid, err in unreadable:
        r.sessions_checked += 1
        r.sessions_broken += 1
        r.sessions_unreadable += 1
        add_problem(
            Problem("session_unreadable", None, err, session=f"{scope[:8]}/{_redact_session(sid)}")
        )
    for batch in batched(records, BATCH):
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
        if key_ns(key) != rec.ns:
            return problem(
                "corrupt", f"object key is in namespace {key_ns(key)}, entry in {rec.ns}"
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
        if check is None or key_ns(key) != rec.ns:
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


__all__ = ["Problem", "VerifyReport", "verify"]
