"""SQLite index: the embedded default, shared by every process on one machine.

Concurrency model: each ``SQLiteIndex`` holds one connection guarded by a lock (so one object
is thread-safe), and processes coordinate through SQLite's own file locking. WAL mode lets
readers proceed while one writer commits; every write transaction starts with
``BEGIN IMMEDIATE`` so it queues on the busy handler instead of failing the way a deferred
transaction does when it has to upgrade a stale WAL snapshot.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import ConfigError, IndexBackendError, IndexUnavailableError
from .base import DEFAULT_TTL_SECONDS, EntryRecord, Index, IndexEntry, IndexSummary
from .deferred import Deferred
from .sqlite_totals import ensure_totals, read_totals, sample_entries

log = logging.getLogger("kvcloud.index")

SCHEMA_VERSION = 1

# Conservative: SQLite builds before 3.32 allow only 999 bound variables per statement.
_MAX_IN_VARS = 500
_PAGE_ROWS = 1000
_PURGE_BATCH = 10_000

_SCHEMA = (
    # WITHOUT ROWID: the (ns, fp) primary key *is* the lookup path, so cluster rows on it.
    """CREATE TABLE IF NOT EXISTS entries (
        ns TEXT NOT NULL,
        fp TEXT NOT NULL,
        object_key TEXT NOT NULL,
        n_tokens INTEGER NOT NULL,
        size INTEGER NOT NULL,
        created REAL NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (ns, fp)
    ) WITHOUT ROWID""",
    # Lets the periodic purge find expired rows without scanning the whole table.
    "CREATE INDEX IF NOT EXISTS entries_expires_at ON entries (expires_at)",
    # A normal rowid table: session records carry token histories and can be large, which
    # WITHOUT ROWID tables handle poorly.
    """CREATE TABLE IF NOT EXISTS sessions (
        scope TEXT NOT NULL,
        session_id TEXT NOT NULL,
        record BLOB NOT NULL,
        expires_at REAL,
        PRIMARY KEY (scope, session_id)
    )""",
    """CREATE TABLE IF NOT EXISTS counters (
        name TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    ) WITHOUT ROWID""",
)

_ENTRY_COLUMNS = "ns, fp, object_key, n_tokens, size, created, expires_at"


def _chunks(items: Sequence[str], size: int = _MAX_IN_VARS) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


class SQLiteIndex(Index):
    """Index in one SQLite file. ``path`` may be ``":memory:"`` for throwaway use."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        *,
        busy_timeout: float = 10.0,
        purge_interval: float = 300.0,
        renew_delay: float = 0.05,
        create: bool = True,
    ) -> None:
        """``create=False`` (readers: stats, verify, gc, doctor): the database must exist and
        hold a kvcloud index, so a mistyped path is an error instead of a new, empty index."""
        super().__init__(ttl_seconds)
        if self.ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self.path = str(path)
        if not create:
            require_database(self.path)
        self.url = f"sqlite://{self.path}"
        self.busy_timeout = float(busy_timeout)
        self.purge_interval = float(purge_interval)
        self._lock = threading.RLock()
        self._next_purge = 0.0  # monotonic; 0 purges on the first write
        self._conn: sqlite3.Connection | None = self._open()
        # Lookups only read: the sliding-TTL renewals of their hits and their counters are
        # written by a background thread, batched, so a request never waits for the write
        # lock (which another process may hold for a whole registration).
        self._deferred = Deferred(
            self._write_side_effects, f"kvcloud-sqlite-{Path(self.path).name}", delay=renew_delay
        )
        weakref.finalize(self, self._deferred.stop)
        self._flush_timeout = self.busy_timeout + 1.0

    # -- connection and schema --------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        memory = self.path == ":memory:"
        try:
            if not memory:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IndexUnavailableError(
                f"sqlite index {self.path}: cannot create its directory ({exc})"
            ) from exc
        # Several processes may open a fresh file at the same moment; switching it to WAL and
        # creating the schema both need the write lock, and a few of those steps can report
        # "locked" without consulting the busy handler, so retry them until busy_timeout.
        deadline = time.monotonic() + self.busy_timeout
        while True:
            conn: sqlite3.Connection | None = None
            try:
                conn = sqlite3.connect(
                    self.path,
                    timeout=self.busy_timeout,
                    isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                    check_same_thread=False,  # guarded by self._lock instead
                )
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
                if not memory:
                    conn.execute("PRAGMA journal_mode = WAL")
                # NORMAL is crash-safe in WAL mode; a power cut may lose the last commits,
                # which only forgets hints (the index is a hint, invariant 4).
                conn.execute("PRAGMA synchronous = NORMAL")
                self._ensure_schema(conn)
                # running totals for summary() (sqlite_totals); False: a read-only file
                self._totals = ensure_totals(conn)
                return conn
            except sqlite3.Error as exc:
                if conn is not None:
                    conn.close()
                if _is_busy(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise self._translate(exc) from exc

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise IndexBackendError(
                f"sqlite index {self.path} has schema version {version}, newer than this "
                f"kvcloud understands ({SCHEMA_VERSION}); upgrade kvcloud"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have created it while we waited for the lock.
            if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                for stmt in _SCHEMA:
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise

    def _translate(self, exc: sqlite3.Error) -> IndexBackendError:
        if _is_busy(exc) or "unable to open" in str(exc).lower():
            return IndexUnavailableError(
                f"sqlite index {self.path}: {exc} (waited {self.busy_timeout:g}s; check for "
                "a process holding the database, a slow or full disk, or file permissions)"
            )
        return IndexBackendError(f"sqlite index {self.path}: {exc}")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                raise IndexBackendError(f"sqlite index {self.path} is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: committed on success, rolled back on any error."""
        with self._read() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
            self._maybe_purge(conn)

    def _maybe_purge(self, conn: sqlite3.Connection) -> None:
        # Expired rows are already invisible to every query; deleting them only reclaims
        # space, so it runs rarely, in bounded batches, and never fails the caller.
        if time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + self.purge_interval
        now = time.time()
        try:
            conn.execute("BEGIN IMMEDIATE")
            purged = conn.execute(
                "DELETE FROM entries WHERE (ns, fp) IN "
                "(SELECT ns, fp FROM entries WHERE expires_at <= ? LIMIT ?)",
                (now, _PURGE_BATCH),
            ).rowcount
            if purged >= _PURGE_BATCH:
                # a backlog: keep at it every second, so that the expired rows stored (what
                # summary() reads past) stay bounded however fast entries expire
                self._next_purge = time.monotonic() + 1.0
            conn.execute(
                "DELETE FROM sessions WHERE rowid IN (SELECT rowid FROM sessions "
                "WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT ?)",
                (now, _PURGE_BATCH),
            )
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            _rollback(conn)
            log.debug("sqlite index %s: purge skipped: %s", self.path, exc)

    # -- entries ----------------------------------------------------------------------------

    def register(self, ns: str, fp: str, entry: IndexEntry) -> bool:
        return self.register_many(ns, [(fp, entry)])[0]

    def register_many(self, ns: str, entries: Sequence[tuple[str, IndexEntry]]) -> list[bool]:
        entries = list(entries)
        if not entries:
            return []
        now = time.time()
        created: list[bool] = []
        # One IMMEDIATE transaction for the whole batch: SQLite's one round trip (a single
        # lock acquisition and a single commit, i.e. one fsync of the WAL, not one per entry).
        with self._write() as conn:
            for fp, entry in entries:
                # An expired row counts as absent, so clear it first and let INSERT OR IGNORE
                # provide the SET NX semantics (entry by entry: a repeated fp in the batch
                # is created once, like consecutive SET NX).
                conn.execute(
                    "DELETE FROM entries WHERE ns = ? AND fp = ? AND expires_at <= ?",
                    (ns, fp, now),
                )
                cur = conn.execute(
                    f"INSERT OR IGNORE INTO entries ({_ENTRY_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        ns,
                        fp,
                        entry.object_key,
                        int(entry.n_tokens),
                        int(entry.size),
                        float(entry.created),
                        now + self.ttl_seconds,
                    ),
                )
                created.append(cur.rowcount == 1)
        return created

    def lookup(
        self,
        ns: str,
        fps: Sequence[str],
        counters: Mapping[str, int] | None = None,
        *,
        renew: bool = True,
    ) -> list[IndexEntry | None]:
        fps = list(fps)
        if not fps:
            if counters:
                self._deferred.submit((), counters)
            return []
        unique = list(dict.fromkeys(fps))
        found: dict[str, IndexEntry] = {}
        renewals: list[tuple[str, str]] = []
        now = time.time()
        fresh = self.renewal_due(now)
        with self._read() as conn:
            for part in _chunks(unique):
                rows = conn.execute(
                    "SELECT fp, object_key, n_tokens, size, created, expires_at FROM entries "
                    f"WHERE ns = ? AND fp IN ({_placeholders(len(part))}) AND expires_at > ?",
                    (ns, *part, now),
                )
                for fp, object_key, n_tokens, size, created, expires_at in rows:
                    found[fp] = IndexEntry(object_key, int(n_tokens), int(size), float(created))
                    if renew and expires_at < fresh:
                        renewals.append((ns, fp))
        if renewals or counters:
            self._deferred.submit(renewals, counters)
        return [found.get(fp) for fp in fps]

    def _write_side_effects(self, items: list[Any], counters: dict[str, int]) -> None:
        """Background thread: slide the expiry of lookup hits ((ns, fp) pairs) that have
        not expired meanwhile (a renewal never resurrects an entry), and add ``counters``."""
        now = time.time()
        new = now + self.ttl_seconds
        with self._write() as conn:
            conn.executemany(
                "UPDATE entries SET expires_at = ? "
                "WHERE ns = ? AND fp = ? AND expires_at > ? AND expires_at < ?",
                [(new, ns, fp, now, new) for ns, fp in items],
            )
            if counters:
                self._add_counters(conn, counters)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the TTL renewals and counters of earlier lookups were written (or
        failed); False if that took longer than ``timeout``."""
        return self._deferred.flush(self._flush_timeout if timeout is None else timeout)

    def drop(self, ns: str, fp: str, object_key: str | None = None) -> bool:
        sql = "DELETE FROM entries WHERE ns = ? AND fp = ? AND expires_at > ?"
        params: tuple[object, ...] = (ns, fp, time.time())
        if object_key is not None:
            sql += " AND object_key = ?"
            params += (object_key,)
        with self._write() as conn:
            return conn.execute(sql, params).rowcount > 0

    def iter_entries(self, ns: str | None = None) -> Iterator[EntryRecord]:
        # Keyset pagination: each page is its own short read, so the lock is never held
        # across a yield and callers may use the index while iterating.
        cursor: tuple[str, str] | None = None
        while True:
            where = ["expires_at > ?"]
            params: list[object] = [time.time()]
            if ns is not None:
                where.append("ns = ?")
                params.append(ns)
            if cursor is not None:
                where.append("(ns, fp) > (?, ?)")
                params.extend(cursor)
            sql = (
                f"SELECT {_ENTRY_COLUMNS} FROM entries WHERE {' AND '.join(where)} "
                "ORDER BY ns, fp LIMIT ?"
            )
            with self._read() as conn:
                rows = conn.execute(sql, (*params, _PAGE_ROWS)).fetchall()
            for row_ns, fp, object_key, n_tokens, size, created, expires_at in rows:
                entry = IndexEntry(object_key, int(n_tokens), int(size), float(created))
                yield EntryRecord(ns=row_ns, fp=fp, entry=entry, expires_at=float(expires_at))
            if len(rows) < _PAGE_ROWS:
                return
            cursor = (rows[-1][0], rows[-1][1])

    def summary(self, sample_size: int = 512) -> IndexSummary:
        """From the running totals (sqlite_totals), less the expired rows not yet purged, in
        one snapshot, plus at most ``sample_size`` entries per namespace; reads only."""
        if not self._totals:
            return super().summary(sample_size)
        now, rng = time.time(), random.Random()
        with self._read() as conn:
            conn.execute("BEGIN")
            try:
                namespaces, sessions = read_totals(conn, now)
                sample = [
                    rec
                    for ns, t in namespaces.items()
                    for rec in sample_entries(conn, ns, sample_size, t.entries, now, rng)
                ]
            finally:
                conn.execute("COMMIT")
        return IndexSummary(namespaces, sessions, True, self.counters(), sample)

    def count_entries(self, ns: str | None = None) -> int:
        sql = "SELECT COUNT(*) FROM entries WHERE expires_at > ?"
        params: tuple[object, ...] = (time.time(),)
        if ns is not None:
            sql += " AND ns = ?"
            params += (ns,)
        with self._read() as conn:
            return int(conn.execute(sql, params).fetchone()[0])

    # -- sessions ---------------------------------------------------------------------------

    def put_session(
        self, scope: str, session_id: str, record: bytes, ttl_seconds: int | None = None
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive (or None for no expiry)")
        expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
        with self._write() as conn:
            conn.execute(
                "INSERT INTO sessions (scope, session_id, record, expires_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (scope, session_id) DO UPDATE SET "
                "record = excluded.record, expires_at = excluded.expires_at",
                (scope, session_id, bytes(record), expires_at),
            )

    def get_session(self, scope: str, session_id: str) -> bytes | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT record FROM sessions WHERE scope = ? AND session_id = ? "
                "AND (expires_at IS NULL OR expires_at > ?)",
                (scope, session_id, time.time()),
            ).fetchone()
        return None if row is None else bytes(row[0])

    def delete_session(self, scope: str, session_id: str) -> bool:
        with self._write() as conn:
            cur = conn.execute(
                "DELETE FROM sessions WHERE scope = ? AND session_id = ? "
                "AND (expires_at IS NULL OR expires_at > ?)",
                (scope, session_id, time.time()),
            )
            return cur.rowcount > 0

    def iter_sessions(self) -> Iterator[tuple[str, str, bytes]]:
        cursor: tuple[str, str] | None = None
        while True:
            sql = (
                "SELECT scope, session_id, record FROM sessions "
                "WHERE (expires_at IS NULL OR expires_at > ?)"
            )
            params: list[object] = [time.time()]
            if cursor is not None:
                sql += " AND (scope, session_id) > (?, ?)"
                params.extend(cursor)
            sql += " ORDER BY scope, session_id LIMIT ?"
            with self._read() as conn:
                rows = conn.execute(sql, (*params, _PAGE_ROWS)).fetchall()
            for scope, session_id, record in rows:
                yield scope, session_id, bytes(record)
            if len(rows) < _PAGE_ROWS:
                return
            cursor = (rows[-1][0], rows[-1][1])

    # -- counters and health ----------------------------------------------------------------

    @staticmethod
    def _add_counters(conn: sqlite3.Connection, counters: Mapping[str, int]) -> None:
        conn.executemany(
            "INSERT INTO counters (name, value) VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
            [(str(name), int(n)) for name, n in counters.items()],
        )

    def incr(self, counters: Mapping[str, int]) -> None:
        if not counters:
            return
        with self._write() as conn:
            self._add_counters(conn, counters)

    def counters(self) -> dict[str, int]:
        # Read your own writes: increments given to lookup() may still be queued.
        self._deferred.flush(self._flush_timeout)
        with self._read() as conn:
            return {name: int(v) for name, v in conn.execute("SELECT name, value FROM counters")}

    def ping(self) -> float:
        start = time.perf_counter()
        with self._read() as conn:
            # Reads the database header, so a vanished or unreadable file shows up here.
            conn.execute("PRAGMA user_version").fetchone()
        return max(time.perf_counter() - start, 1e-9)

    def close(self) -> None:
        # Pending counters are written first, so a clean close never loses them.
        if self._conn is not None:
            self._deferred.close(self._flush_timeout)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def require_database(path: str) -> None:
    """Check that ``path`` is an existing kvcloud SQLite index without creating or changing
    anything; ConfigError naming it otherwise."""
    if path == ":memory:":
        return
    where = f"sqlite://{path}"
    if not os.path.exists(path):
        raise ConfigError(
            f"no index at {where}: the file does not exist "
            "(check the index URL, KVCLOUD_INDEX or --index)"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"no index at {where}: it is not a file")
    try:
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=1)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc).lower():
            raise ConfigError(f"{where} is not a kvcloud index ({exc})") from None
        return  # locked or unreadable right now: the real open waits or says why
    if version == 0:
        raise ConfigError(f"{where} is not a kvcloud index (it holds no kvcloud tables)")


def _is_busy(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # SQLite may already have rolled back on its own (e.g. after SQLITE_FULL).
        with suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


__all__ = ["SCHEMA_VERSION", "SQLiteIndex", "require_database"]
