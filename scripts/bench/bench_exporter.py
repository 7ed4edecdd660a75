"""What one collection of ``kvcloud stats --serve`` costs as the index grows: the exporter's
collection from the index's bookkeeping (``collect_summary``, what ``--serve`` runs every
``--interval``) against the full scan it ran before (``collect_stats``: every entry read;
the store listing it also did is left out here), at 10^4, 10^5 and 10^6 entries, on a real
redis-server (started here on a free port, no persistence) and on the SQLite index.

Both indexes are filled with pipelined bulk registrations (``register_many``, no objects
written: the figures need entries only), one namespace, ``--buckets`` buckets on Redis, plus
``--sessions`` session records. At each size: seconds per collection (median of ``--repeat``;
the full scan once at the largest size) and, on Redis, the commands the collection sent
(``INFO commandstats`` delta), and the bookkeeping's own memory (``MEMORY USAGE`` of the
namespace's hash). Also the cost the bookkeeping adds to a registration (``register_many`` of
``--write-check`` entries with and without the tally).

    python scripts/bench/bench_exporter.py --out docs/bench/exporter.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis

from kvcloud.indexes import IndexEntry, RedisIndex, SQLiteIndex
from kvcloud.tools.cli.stats import collect_stats, collect_summary
from tests.servers import redis_family_version, start_redis

NS = "b4aaf33481c9944c22e29c41db39259c"
SIZES = (10_000, 100_000, 1_000_000)
BATCH = 8192


def fingerprints(n: int) -> list[str]:
    raw = os.urandom(32 * n).hex()
    return [raw[i : i + 64] for i in range(0, len(raw), 64)]


def entries(n: int) -> list[tuple[str, IndexEntry]]:
    now = time.time()
    out = []
    for fp in fingerprints(n):
        digest = fp[::-1]
        key = f"{NS}/{digest[:2]}/{digest}.b3"
        out.append((fp, IndexEntry(key, 256, 3_145_728, now)))
    return out


def fill(index: Any, n: int) -> float:
    t0 = time.perf_counter()
    batch = entries(n)
    for i in range(0, n, BATCH):
        index.register_many(NS, batch[i : i + BATCH])
    if hasattr(index, "flush"):
        index.flush()
    return time.perf_counter() - t0


def commands(client: redis.Redis | None) -> int:
    if client is None:
        return 0
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def timed(fn: Any, client: redis.Redis | None, repeat: int) -> dict[str, Any]:
    seconds, sent = [], []
    for _ in range(repeat):
        before = commands(client)
        t0 = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t0)
        sent.append(commands(client) - before)
    out: dict[str, Any] = {"seconds": round(statistics.median(seconds), 4), "runs": repeat}
    if client is not None:
        out["commands"] = int(statistics.median(sent))
    out["entries_reported"] = result["entries"]
    out["sessions_reported"] = result["sessions"]
    if result.get("sessions_exact") is False:
        out["sessions_estimated"] = True
    return out


def write_overhead(url: str, n: int) -> dict[str, float]:
    """Seconds to register ``n`` entries with the bookkeeping's tallies and without (the
    tallies sent, as in production, by the background thread; flushed in the time): the
    better of two runs each, alternating."""

    class Untallied(RedisIndex):
        def _tally_registered(self, *args: Any) -> None:
            pass

    best: dict[str, float] = {}
    for name, cls in [("without", Untallied), ("with_bookkeeping", RedisIndex)] * 2:
        client = redis.Redis.from_url(url.partition("?")[0])
        client.flushdb()
        with cls(url) as idx:
            idx.ping()
            seconds = fill(idx, n)
        best[name] = round(min(seconds, best.get(name, seconds)), 3)
        client.close()
    return best


def sqlite_write_overhead(n: int) -> dict[str, float]:
    """Seconds to register ``n`` entries into SQLite with the bookkeeping's triggers and
    without them (dropped): the better of two runs each, alternating."""
    best: dict[str, float] = {}
    for name in ["without", "with_bookkeeping"] * 2:
        with tempfile.TemporaryDirectory() as tmp, SQLiteIndex(Path(tmp) / "i.db") as idx:
            if name == "without":
                for trigger in ("insert", "delete", "update"):
                    idx._conn.execute(f"DROP TRIGGER entry_totals_{trigger}")  # type: ignore[union-attr]
            seconds = fill(idx, n)
        best[name] = round(min(seconds, best.get(name, seconds)), 3)
    return best


def bench(backend: str, index: Any, url: str, client: redis.Redis | None, a: Any) -> list[dict]:
    args = argparse.Namespace(store=None, index=url, no_store=True)
    rows = []
    have = 0
    for size in a.sizes:
        fill_s = fill(index, size - have)
        have = size
        row: dict[str, Any] = {
            "backend": backend,
            "entries": size,
            "fill_seconds": round(fill_s, 1),
        }
        collect_summary(args, a.sample)  # connect once (scripts, NO-TOUCH) before timing
        row["new"] = timed(lambda: collect_summary(args, a.sample), client, a.repeat)
        full_runs = 1 if size >= 1_000_000 else min(3, a.repeat)
        row["old"] = timed(lambda: collect_stats(args, show=False), client, full_runs)
        if client is not None:
            key = f"kvc:n:{NS}"
            row["bookkeeping_bytes"] = int(client.memory_usage(key) or 0)
            row["bookkeeping_fields"] = int(client.hlen(key))
            row["used_memory"] = int(client.info("memory")["used_memory"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="redis8", help="redis7, redis8 or valkey9")
    ap.add_argument("--buckets", type=int, default=16_384)
    ap.add_argument("--sample", type=int, default=512)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--write-check", type=int, default=200_000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", flavor=a.flavor)
        try:
            url = f"{server.url}?buckets={a.buckets}"
            client = redis.Redis.from_url(server.url)
            write = write_overhead(url, a.write_check)
            print(json.dumps({"register_seconds": write}), flush=True)
            sqlite_write = sqlite_write_overhead(a.write_check)
            print(json.dumps({"sqlite_register_seconds": sqlite_write}), flush=True)
            client.flushdb()
            with RedisIndex(url) as idx:
                for i in range(a.sessions):
                    idx.put_session("tenant", f"s{i}", b"x" * 512)
                results += bench("redis", idx, url, client, a)
            client.close()
        finally:
            server.stop()
        path = Path(tmp) / "index.db"
        with SQLiteIndex(path) as idx:
            for i in range(a.sessions):
                idx.put_session("tenant", f"s{i}", b"x" * 512)
            results += bench("sqlite", idx, f"sqlite://{path}", None, a)
    meta = {
        "server": f"{a.flavor} {redis_family_version(a.flavor)}",
        "buckets": a.buckets,
        "sample": a.sample,
        "sessions": a.sessions,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "register_seconds": {"entries": a.write_check, **write},
        "sqlite_register_seconds": {"entries": a.write_check, **sqlite_write},
        "command": "python scripts/bench/bench_exporter.py --out docs/bench/exporter.json",
    }
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
