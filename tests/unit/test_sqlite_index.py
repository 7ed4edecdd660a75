"""SQLiteIndex behaviour beyond the contract: several processes, schema, error mapping."""

from __future__ import annotations

import multiprocessing
import sqlite3
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvcloud.errors import IndexBackendError, IndexUnavailableError
from kvcloud.indexes import IndexEntry, SQLiteIndex
from kvcloud.indexes.sqlite import SCHEMA_VERSION

N_PROCS = 8
SHARED_FPS = 100  # every process registers all of these
OWN_FPS = 60  # and a window that overlaps its two neighbours'


def fp(i: int) -> str:
    return f"{i:064x}"


def entry(i: int, writer: int) -> IndexEntry:
    return IndexEntry(f"segments/{i}/w{writer}", 256, 4096, float(writer))


def _fps_for(writer: int) -> list[int]:
    own = range(1000 + writer * (OWN_FPS // 2), 1000 + writer * (OWN_FPS // 2) + OWN_FPS)
    return [*range(SHARED_FPS), *own]


def _register_worker(path: str, writer: int, barrier: Any, results: Any) -> None:
    # Module-level so the spawn start method can import it in the child.
    try:
        barrier.wait(timeout=60)
        idx = SQLiteIndex(path)  # all at once: creating the directory and schema races too
        outcome = []
        for i in _fps_for(writer):
            created = idx.register("ns", fp(i), entry(i, writer))
            outcome.append((i, created))
            # Interleave lookups (write transactions too: they renew TTLs and count).
            idx.lookup("ns", [fp(i), fp(i + 1)], counters={"lookups": 1})
        idx.close()
        results.put((writer, outcome, None))
    except BaseException:
        results.put((writer, [], traceback.format_exc()))


def test_many_processes_register_concurrently(tmp_path: Path) -> None:
    path = str(tmp_path / "shared" / "index.db")  # the directory does not exist yet
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_register_worker, args=(path, w, barrier, results))
        for w in range(N_PROCS)
    ]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    errors = [err for _, _, err in reports if err]
    assert errors == [], errors[0]
    wins: Counter[int] = Counter()
    calls: Counter[int] = Counter()
    for writer, outcome, _ in reports:
        assert [i for i, _ in outcome] == _fps_for(writer)  # every call returned
        for i, created in outcome:
            calls[i] += 1
            wins[i] += created
    expected_calls = Counter(i for w in range(N_PROCS) for i in _fps_for(w))
    assert calls == expected_calls
    assert set(wins) == set(expected_calls)
    assert all(n == 1 for n in wins.values()), {i: n for i, n in wins.items() if n != 1}

    with SQLiteIndex(path) as idx:
        assert idx.count_entries("ns") == len(expected_calls)
        # The stored entry is the winner's.
        winners = {i: w for w, outcome, _ in reports for i, created in outcome if created}
        for i, w in winners.items():
            assert idx.lookup("ns", [fp(i)]) == [entry(i, w)]
        assert idx.counters() == {"lookups": sum(expected_calls.values())}


def test_lookup_chunks_past_the_variable_limit(tmp_path: Path) -> None:
    with SQLiteIndex(tmp_path / "index.db") as idx:
        for i in range(0, 3000, 7):
            idx.register("ns", fp(i), entry(i, 0))
        got = idx.lookup("ns", [fp(i) for i in range(3000)])
        assert got == [entry(i, 0) if i % 7 == 0 else None for i in range(3000)]
        assert len(list(idx.iter_entries("ns"))) == len(range(0, 3000, 7))


def test_schema_and_pragmas(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    SQLiteIndex(path).close()
    SQLiteIndex(path).close()  # reopening is idempotent
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"entries", "sessions", "counters"} <= tables
    finally:
        conn.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(IndexBackendError, match="newer"):
        SQLiteIndex(path)


def test_expired_rows_are_purged(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    with SQLiteIndex(path, ttl_seconds=1, purge_interval=0) as idx:
        idx.register("ns", fp(1), entry(1, 0))
        idx.put_session("t", "s", b"r", ttl_seconds=1)
        time.sleep(1.1)
        idx.incr({"x": 1})  # any write may purge
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 0
    finally:
        conn.close()


def test_held_lock_maps_to_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    idx = SQLiteIndex(path, busy_timeout=0.2)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        start = time.monotonic()
        with pytest.raises(IndexUnavailableError, match="locked"):
            idx.register("ns", fp(1), entry(1, 0))
        assert time.monotonic() - start < 2.0
        assert idx.lookup("ns", []) == []  # nothing to do needs no lock
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert idx.register("ns", fp(1), entry(1, 0)) is True  # and it recovers
    idx.close()


def test_closed_index_raises(tmp_path: Path) -> None:
    idx = SQLiteIndex(tmp_path / "index.db")
    idx.close()
    idx.close()
    with pytest.raises(IndexBackendError, match="closed"):
        idx.ping()


def test_memory_index() -> None:
    with SQLiteIndex(":memory:") as idx:
        assert idx.register("ns", fp(1), entry(1, 0))
        assert idx.lookup("ns", [fp(1)]) == [entry(1, 0)]


def test_register_many_is_one_transaction(tmp_path: Path) -> None:
    with SQLiteIndex(tmp_path / "index.db", purge_interval=3600) as idx:
        idx.register("ns", fp(0), entry(0, 0))
        statements: list[str] = []
        assert idx._conn is not None
        idx._conn.set_trace_callback(statements.append)
        got = idx.register_many("ns", [(fp(i), entry(i, 1)) for i in range(128)])
        idx._conn.set_trace_callback(None)
        assert got == [False] + [True] * 127
        # one lock acquisition and one commit for the whole batch
        assert [s for s in statements if s.split()[0] in ("BEGIN", "COMMIT")] == [
            "BEGIN IMMEDIATE",
            "COMMIT",
        ]
        assert idx.lookup("ns", [fp(0), fp(1)]) == [entry(0, 0), entry(1, 1)]


def test_register_many_is_all_or_nothing(tmp_path: Path) -> None:
    with SQLiteIndex(tmp_path / "index.db") as idx:
        bad = IndexEntry("segments/bad", "many", 4096, 0.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            idx.register_many("ns", [(fp(1), entry(1, 0)), (fp(2), bad)])
        assert idx.lookup("ns", [fp(1), fp(2)]) == [None, None]
        assert idx.register_many("ns", [(fp(1), entry(1, 0))]) == [True]


def test_lookup_never_waits_for_the_write_lock(tmp_path: Path) -> None:
    # A registration in another process holds the write lock for a while; a lookup must not
    # queue behind it (its TTL renewals and counters are written later, in the background).
    path = tmp_path / "index.db"
    entry = IndexEntry("ns/ab/" + "ab" * 32, 16, 1, 1.0)
    with SQLiteIndex(path, ttl_seconds=100) as short:
        short.register("ns", "f" * 64, entry)
    idx = SQLiteIndex(path, ttl_seconds=10_000, busy_timeout=5.0)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # what a writer holds while it commits
    try:
        start = time.monotonic()
        assert idx.lookup("ns", ["f" * 64, "0" * 64], counters={"hits": 1}) == [entry, None]
        assert idx.lookup_run("ns", ["f" * 64, "0" * 64, "f" * 64]) == [entry]
        assert time.monotonic() - start < 1.0  # not the 5 s busy timeout
    finally:
        holder.execute("COMMIT")
        holder.close()
    # once the lock is free the background writes land: the hit slid, the counter counted
    assert idx.counters() == {"hits": 1}
    (record,) = list(idx.iter_entries("ns"))
    assert record.expires_at is not None and record.expires_at > time.time() + 9_000
    idx.close()
