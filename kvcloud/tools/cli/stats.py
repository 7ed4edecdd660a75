"""``kvcloud stats``: entries, bytes, sessions and counters from one full scan, as a table,
JSON, Prometheus text, or a Prometheus exporter (``--serve``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table

from ..exporter import DEFAULT_PORT, StatsExporter, parse_listen, prometheus_text
from .common import (
    add_backend_args,
    backend_config,
    emit_json,
    human_bytes,
    open_backend_index,
    open_backend_store,
)


def _progress(enabled: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed:,}"),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )


def collect_stats(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    """One full scan: entries per namespace from the index, objects from the store."""
    per_ns: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "bytes": 0, "tokens": 0})
    collected_at = time.time()
    with open_backend_index(args) as index:
        with _progress(show) as progress:
            task = progress.add_task("scanning index entries", total=None)
            for rec in index.iter_entries():
                d = per_ns[rec.ns]
                d["entries"] += 1
                d["bytes"] += rec.entry.size
                d["tokens"] += rec.entry.n_tokens
                progress.advance(task)
        sessions = sum(1 for _ in index.iter_sessions())
        counters = index.counters()
        index_url = index.url
    result: dict[str, Any] = {
        "index": index_url,
        "entries": sum(d["entries"] for d in per_ns.values()),
        "entry_bytes": sum(d["bytes"] for d in per_ns.values()),
        "tokens": sum(d["tokens"] for d in per_ns.values()),
        "sessions": sessions,
        "namespaces": dict(per_ns),
        "counters": counters,
        "collected_at": collected_at,
    }
    if not args.no_store:
        objects = obj_bytes = 0
        with open_backend_store(args) as store, _progress(show) as progress:
            task = progress.add_task("listing store objects", total=None)
            for info in store.list():
                objects += 1
                obj_bytes += info.size
                progress.advance(task)
            result["store"] = store.url
        result["objects"] = objects
        result["object_bytes"] = obj_bytes
    return result


def cmd_stats(args: argparse.Namespace) -> int:
    if args.serve:
        return _serve_stats(args)
    show = not args.json and not args.prometheus and sys.stderr.isatty()
    result = collect_stats(args, show)
    if args.prometheus:
        sys.stdout.write(prometheus_text(result))
        return 0
    if args.json:
        emit_json(result)
        return 0
    console = Console()
    console.print(f"index  {result['index']}")
    if "store" in result:
        console.print(f"store  {result['store']}")
    table = Table("namespace", "entries", "tokens", "bytes")
    for ns, d in sorted(result["namespaces"].items()):
        table.add_row(ns, f"{d['entries']:,}", f"{d['tokens']:,}", human_bytes(d["bytes"]))
    table.add_row(
        "[b]total",
        f"{result['entries']:,}",
        f"{result['tokens']:,}",
        human_bytes(result["entry_bytes"]),
    )
    console.print(table)
    line = f"sessions {result['sessions']:,}"
    if "objects" in result:
        line += f"   objects {result['objects']:,} ({human_bytes(result['object_bytes'])})"
    console.print(line)
    if result["counters"]:
        console.print(
            "counters  " + "  ".join(f"{k}={v:,}" for k, v in sorted(result["counters"].items()))
        )
    return 0


def _serve_stats(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.serve)
    # Fail fast on a wrong URL or scheme before listening; an unreachable server is not
    # fatal here (it may come up later), the exporter reports it as kvcloud_stats_up 0.
    backend_config(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    exporter = StatsExporter(lambda: collect_stats(args, show=False), args.interval)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: exporter.stop())
    exporter.serve(host, port)
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("stats", help="entries, bytes, sessions and counters")
    add_backend_args(s)
    s.add_argument("--no-store", action="store_true", help="skip listing the object store")
    s.add_argument(
        "--prometheus", action="store_true", help="print the figures in Prometheus text format"
    )
    s.add_argument(
        "--serve",
        metavar="[HOST:]PORT",
        help=f"run as a Prometheus exporter on this address (e.g. {DEFAULT_PORT} or "
        f"0.0.0.0:{DEFAULT_PORT}; host defaults to 127.0.0.1), rescanning every --interval",
    )
    s.add_argument(
        "--interval",
        type=float,
        default=60.0,
        help="with --serve: seconds between scans (default 60; a scan lists every entry and "
        "object, so keep it well above the scan time kvcloud_stats_scan_seconds)",
    )
    s.set_defaults(func=cmd_stats)
