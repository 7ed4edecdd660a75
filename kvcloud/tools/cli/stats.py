"""``kvcloud stats``: entries, bytes, sessions and counters from one full scan, as a table,
JSON or Prometheus text; or a Prometheus exporter (``--serve``) that reads the index's own
bookkeeping and a bounded sample instead, at a cost independent of the store's size
(kvcloud/tools/exporter.py). Neither renews a TTL or, on Redis 7.2+ and Valkey, touches the
LRU clocks eviction goes by.
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

from ...errors import KVCloudError
from ...indexes.base import Index
from ..exporter import (
    DEFAULT_PORT,
    StatsExporter,
    parse_listen,
    prometheus_text,
    summarize_sample,
)
from .common import (
    add_backend_args,
    announce,
    backend_config,
    backend_sources,
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


def _open_stats_index(args: argparse.Namespace) -> Index:
    """The configured index, with a Redis index's reads under CLIENT NO-TOUCH: stats must
    not make what they read look used."""
    return open_backend_index(args, no_touch=True)


def list_store(args: argparse.Namespace, show: bool = False) -> dict[str, Any]:
    """Every object in the store: their number and bytes (one full listing, O(store))."""
    objects = obj_bytes = 0
    with open_backend_store(args) as store, _progress(show) as progress:
        task = progress.add_task("listing store objects", total=None)
        for info in store.list():
            objects += 1
            obj_bytes += info.size
            progress.advance(task)
        url = store.url
    return {"store": url, "objects": objects, "object_bytes": obj_bytes}


def collect_summary(args: argparse.Namespace, sample_size: int) -> dict[str, Any]:
    """What the exporter serves: the index's bookkeeping (``Index.summary``) and a sample of
    at most ``sample_size`` entries per namespace; the store's figures estimated from them
    (nothing is listed)."""
    collected_at = time.time()
    with _open_stats_index(args) as index:
        summary = index.summary(sample_size)
        index_url, ttl = index.url, index.ttl_seconds
        lru_untouched = getattr(index, "lru_untouched", None)
    namespaces = {
        ns: {"entries": t.entries, "bytes": t.bytes, "tokens": t.tokens}
        for ns, t in summary.namespaces.items()
    }
    sample = summarize_sample(summary.sample, ttl, collected_at)
    result: dict[str, Any] = {
        "source": "bookkeeping",
        "index": index_url,
        "entries": sum(d["entries"] for d in namespaces.values()),
        "entry_bytes": sum(d["bytes"] for d in namespaces.values()),
        "tokens": sum(d["tokens"] for d in namespaces.values()),
        "sessions": summary.sessions,
        "sessions_exact": summary.sessions_exact,
        "namespaces": namespaces,
        "counters": summary.counters,
        "collected_at": collected_at,
        "sample": sample,
        "sample_size": sample_size,
        "bookkeeping_since": summary.since,
        "lru_untouched": lru_untouched,
    }
    if not args.no_store:
        result["objects_estimate"] = round(
            sum(
                d["entries"] * sample.get(ns, {}).get("objects_per_entry", 1.0)
                for ns, d in namespaces.items()
            )
        )
        result["object_bytes_estimate"] = result["entry_bytes"]
    return result


def collect_stats(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    """One full scan: entries per namespace from the index, objects from the store."""
    per_ns: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "bytes": 0, "tokens": 0})
    collected_at = time.time()
    with _open_stats_index(args) as index:
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
        result.update(list_store(args, show))
    return result


def cmd_stats(args: argparse.Namespace) -> int:
    announce(args, backend_config(args), store=not args.no_store, now=bool(args.serve))
    if args.serve:
        return _serve_stats(args)
    show = not args.json and not args.prometheus and sys.stderr.isatty()
    result = collect_stats(args, show)
    if args.prometheus:
        sys.stdout.write(prometheus_text(result))
        return 0
    if args.json:
        sources = backend_sources(args)
        emit_json(
            {**result, "sources": sources if "store" in result else {"index": sources["index"]}}
        )
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
    if args.sample < 0:
        raise KVCloudError("--sample must be 0 or more")
    listing = args.list_store_every > 0 and not args.no_store
    exporter = StatsExporter(
        lambda: collect_summary(args, args.sample),
        args.interval,
        list_store=(lambda: list_store(args)) if listing else None,
        list_interval=args.list_store_every,
    )
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
        f"0.0.0.0:{DEFAULT_PORT}; host defaults to 127.0.0.1), collecting every --interval "
        "from the index's bookkeeping and a bounded sample (no scan, no listing)",
    )
    s.add_argument(
        "--interval",
        type=float,
        default=60.0,
        help="with --serve: seconds between collections (default 60; each reads the index's "
        "bookkeeping and a sample, independent of the store's size)",
    )
    s.add_argument(
        "--sample",
        type=int,
        default=512,
        metavar="N",
        help="with --serve: entries sampled per namespace for the age, idle-time and size "
        "histograms and the store estimate (default 512; 0: none)",
    )
    s.add_argument(
        "--list-store-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --serve: also list the whole store on this slower clock, in the background, "
        "for exact kvcloud_store_objects/bytes (O(store): e.g. 86400; default 0: never, the "
        "figures are estimated from the index)",
    )
    s.set_defaults(func=cmd_stats)
