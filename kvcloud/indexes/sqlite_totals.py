"""SQLite index bookkeeping: live entries, bytes and tokens per namespace and live sessions at
a cost independent of the index's size, and a bounded random sample of entries. What
``kvcloud stats --serve`` reads (:meth:`~kvcloud.indexes.sqlite.SQLiteIndex.summary`).

Triggers keep running totals of the *stored* rows (``entry_totals`` per namespace,
``session_totals``) on every insert and delete. Expired rows stay stored until the purge
deletes them, so the live figures are the totals minus the expired rows still stored, which
the ``expires_at`` indexes find without reading the live ones: the cost follows the purge's
backlog, not the index. The triggers live in the database file, so every writer keeps them
right, a release that does not know them included; a database from before them gets them on
its first open, filled from its rows in the same transaction (once, O(rows)).
"""

from __future__ import annotations

import logging
import random
import sqlite3

from .base import EntryRecord, IndexEntry, NamespaceTotals

log = logging.getLogger("kvcloud.index")

# (not an UPSERT: inside a trigger that fires for an INSERT OR IGNORE, one costs a
# registration 75 % more; these two statements cost it about 25 %, docs/bench/exporter.json)
_ENTRY_ADD = """INSERT OR IGNORE INTO entry_totals VALUES (NEW.ns, 0, 0, 0);
        UPDATE entry_totals SET entries = entries + 1, bytes = bytes + NEW.size,
        tokens = tokens + NEW.n_tokens WHERE ns = NEW.ns;"""
_ENTRY_TAKE = """UPDATE entry_totals SET entries = entries - 1, bytes = bytes - OLD.size,
        tokens = tokens - OLD.n_tokens WHERE ns = OLD.ns;"""

# name -> DDL; created together, or dropped and created again together
_OBJECTS = {
    "entry_totals": """CREATE TABLE entry_totals (
        ns TEXT PRIMARY KEY,
        entries INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        tokens INTEGER NOT NULL
    ) WITHOUT ROWID""",
    "session_totals": """CREATE TABLE session_totals (
        one INTEGER PRIMARY KEY CHECK (one = 0),
        sessions INTEGER NOT NULL
    )""",
    # finds the expired sessions still stored (and lets the purge find them) without reading
    # every record
    "sessions_expires_at": "CREATE INDEX sessions_expires_at ON sessions (expires_at) "
    "WHERE expires_at IS NOT NULL",
    "entry_totals_insert": f"CREATE TRIGGER entry_totals_insert AFTER INSERT ON entries "
    f"BEGIN {_ENTRY_ADD} END",
    "entry_totals_delete": f"CREATE TRIGGER entry_totals_delete AFTER DELETE ON entries "
    f"BEGIN {_ENTRY_TAKE} END",
    # kvcloud never rewrites these columns (a renewal sets expires_at only); any tool that did
    # would still keep the totals right
    "entry_totals_update": "CREATE TRIGGER entry_totals_update AFTER UPDATE OF ns, size, "
    f"n_tokens ON entries BEGIN {_ENTRY_TAKE} {_ENTRY_ADD} END",
    "session_totals_insert": "CREATE TRIGGER session_totals_insert AFTER INSERT ON sessions "
    "BEGIN UPDATE session_totals SET sessions = sessions + 1; END",
    "session_totals_delete": "CREATE TRIGGER session_totals_delete AFTER DELETE ON sessions "
    "BEGIN UPDATE session_totals SET sessions = sessions - 1; END",
}
_KINDS = {"entry_totals": "TABLE", "session_totals": "TABLE", "sessions_expires_at": "INDEX"}

_COLUMNS = "fp, object_key, n_tokens, size, created, expires_at"
# random starting points a sample reads from, per namespace
_SAMPLE_STARTS = 16
# a namespace of at most this many times the sample's size is read whole and drawn from
_READ_ALL = 8


def _present(conn: sqlite3.Connection) -> set[str]:
    names = ",".join("?" * len(_OBJECTS))
    rows = conn.execute(f"SELECT name FROM sqlite_master WHERE name IN ({names})", [*_OBJECTS])
    return {name for (name,) in rows}


def ensure_totals(conn: sqlite3.Connection) -> bool:
    """Create the totals, their triggers and the sessions' expiry index where any is missing,
    filled from the rows. False where the database cannot be written (a read-only file):
    ``summary`` then scans. Busy errors propagate (the caller retries them)."""
    if _present(conn) == set(_OBJECTS):
        return True
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "readonly" in str(exc).lower() or "read-only" in str(exc).lower():
            return False
        raise
    try:
        if _present(conn) != set(_OBJECTS):  # another process may have made them meanwhile
            for name in _OBJECTS:
                conn.execute(f"DROP {_KINDS.get(name, 'TRIGGER')} IF EXISTS {name}")
            for ddl in _OBJECTS.values():
                conn.execute(ddl)
            conn.execute(
                "INSERT INTO entry_totals SELECT ns, COUNT(*), SUM(size), SUM(n_tokens) "
                "FROM entries GROUP BY ns"
            )
            conn.execute("INSERT INTO session_totals SELECT 0, COUNT(*) FROM sessions")
            (existing,) = conn.execute("SELECT COALESCE(SUM(entries), 0) FROM entry_totals")
        else:
            existing = (0,)
        conn.execute("COMMIT")
    except sqlite3.OperationalError as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if "readonly" in str(exc).lower():
            return False
        raise
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    # said once per database that already held entries (one from an earlier release); a
    # new database's is part of its schema, not news
    if existing[0]:
        log.info("sqlite index: bookkeeping set up for its %d entries", existing[0])
    return True


def read_totals(conn: sqlite3.Connection, now: float) -> tuple[dict[str, NamespaceTotals], int]:
    """Live figures per namespace and live sessions: the stored totals less the expired rows
    still stored. Run inside one read transaction, so both come from one snapshot."""
    totals = {
        ns: [int(e), int(b), int(t)]
        for ns, e, b, t in conn.execute("SELECT ns, entries, bytes, tokens FROM entry_totals")
    }
    expired = conn.execute(
        "SELECT ns, COUNT(*), SUM(size), SUM(n_tokens) FROM entries "
        "INDEXED BY entries_expires_at WHERE expires_at <= ? GROUP BY ns",
        (now,),
    )
    for ns, e, b, t in expired:
        if ns in totals:
            totals[ns] = [totals[ns][0] - e, totals[ns][1] - b, totals[ns][2] - t]
    stored = conn.execute("SELECT sessions FROM session_totals").fetchone()
    dead = conn.execute(
        "SELECT COUNT(*) FROM sessions INDEXED BY sessions_expires_at "
        "WHERE expires_at IS NOT NULL AND expires_at <= ?",
        (now,),
    ).fetchone()[0]
    namespaces = {ns: NamespaceTotals(*t) for ns, t in totals.items() if t[0] > 0}
    return namespaces, max(0, (stored[0] if stored else 0) - int(dead))


def sample_entries(
    conn: sqlite3.Connection, ns: str, n: int, live: int, now: float, rng: random.Random
) -> list[EntryRecord]:
    """At most ``n`` live entries of ``ns``: drawn from all of them where it has a few times
    ``n`` at most, else the rows after random points of the fingerprint space (fingerprints
    are hashes, so the rows after a random point are a random draw), read through the
    primary key."""
    if n <= 0:
        return []
    if live <= _READ_ALL * n:
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM entries WHERE ns = ? AND expires_at > ? LIMIT ?",
            (ns, now, _READ_ALL * n),
        ).fetchall()
        rows = rng.sample(rows, n) if len(rows) > n else rows
    else:
        per = -(-n // _SAMPLE_STARTS)
        found: dict[str, tuple] = {}
        for _ in range(_SAMPLE_STARTS):
            start = f"{rng.getrandbits(256):064x}"
            got = conn.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE ns = ? AND fp >= ? AND expires_at > ? "
                "ORDER BY fp LIMIT ?",
                (ns, start, now, per),
            ).fetchall()
            if len(got) < per:  # past the last fingerprint: wrap around
                got += conn.execute(
                    f"SELECT {_COLUMNS} FROM entries WHERE ns = ? AND fp < ? AND expires_at > ? "
                    "ORDER BY fp LIMIT ?",
                    (ns, start, now, per - len(got)),
                ).fetchall()
            found.update((row[0], row) for row in got)
        rows = list(found.values())[:n]
    return [
        EntryRecord(ns, fp, IndexEntry(key, int(tokens), int(size), float(created)), float(exp))
        for fp, key, tokens, size, created, exp in rows
    ]


__all__ = ["ensure_totals", "read_totals", "sample_entries"]
