"""The ``kvcloud`` command line: estimate, stats, ls, inspect, verify, gc, bench, doctor.

Every command takes ``--json`` for scripts. Backend commands take ``--store``/``--index``
(default: KVCLOUD_STORE / KVCLOUD_INDEX). Errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn
from rich.table import Table

from . import __version__
from .config import KVCloudConfig
from .errors import CorruptObjectError, KVCloudError, ObjectNotFoundError
from .exporter import DEFAULT_PORT, StatsExporter, parse_listen, prometheus_text
from .indexes.base import Index
from .models import KV_SHAPES
from .namespace import DTYPES
from .segment import digest_from_key, digest_matches, read_header
from .stores.base import ObjectStore

_FP_RE = re.compile(r"^[0-9a-f]{64}$")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --- estimate ----------------------------------------------------------------------------------


def estimate(layers: int, tokens: int, kv_dim: int, bytes_per_element: float) -> dict[str, Any]:
    """The seed's formula: bytes = layers × tokens × kv_dim × bytes_per_element × 2 (K and V)."""
    total = layers * tokens * kv_dim * bytes_per_element * 2
    total_int = int(total)
    return {
        "layers": layers,
        "tokens": tokens,
        "kv_dim": kv_dim,
        "bytes_per_element": bytes_per_element,
        "bytes_per_token": layers * kv_dim * bytes_per_element * 2,
        "bytes": total_int,
        "gib": total_int / 2**30,
        "gb": total_int / 1e9,
    }


def cmd_estimate(args: argparse.Namespace) -> int:
    layers, kv_dim, bpe = args.layers, args.kv_dim, args.bytes_per_element
    if args.model:
        shape = KV_SHAPES.get(args.model)
        if shape is None:
            raise KVCloudError(f"unknown model {args.model!r}; known: {', '.join(KV_SHAPES)}")
        layers = layers or shape.num_layers
        kv_dim = kv_dim or shape.kv_dim
        if bpe is None and args.dtype is None:
            bpe = DTYPES[shape.dtype].itemsize
    if args.dtype:
        if args.dtype not in DTYPES:
            raise KVCloudError(f"unknown dtype {args.dtype!r}; known: {', '.join(DTYPES)}")
        bpe = DTYPES[args.dtype].itemsize
    missing = [
        flag
        for flag, v in (("--layers", layers), ("--kv-dim", kv_dim), ("--bytes-per-element", bpe))
        if not v
    ]
    if missing:
        raise KVCloudError(f"estimate needs {', '.join(missing)} (or --model PRESET)")
    if args.tokens <= 0 or layers <= 0 or kv_dim <= 0 or bpe <= 0:
        raise KVCloudError("all sizes must be positive")
    bpe_value: float = int(bpe) if float(bpe).is_integer() else float(bpe)
    r = estimate(layers, args.tokens, kv_dim, bpe_value)
    if args.model:
        r["model"] = args.model
    if args.json:
        _emit_json(r)
        return 0
    print(f"{r['bytes']:,} bytes = {r['gib']:.2f} GiB = {r['gb']:.2f} GB")
    print(
        f"  {layers} layers × {args.tokens:,} tokens × {kv_dim} kv_dim × {bpe_value} B × 2 (K,V);"
        f" {r['bytes_per_token']:,} bytes/token"
    )
    return 0


# --- backend commands ----------------------------------------------------------------------


def _config(args: argparse.Namespace) -> KVCloudConfig:
    return KVCloudConfig.from_env(store=args.store, index=args.index)


def _open_index(args: argparse.Namespace) -> Index:
    return _config(args).open_index()


def _open_store(args: argparse.Namespace) -> ObjectStore:
    return _config(args).open_store()


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
    with _open_index(args) as index:
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
        with _open_store(args) as store, _progress(show) as progress:
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
        _emit_json(result)
        return 0
    console = Console()
    console.print(f"index  {result['index']}")
    if "store" in result:
        console.print(f"store  {result['store']}")
    table = Table("namespace", "entries", "tokens", "bytes")
    for ns, d in sorted(result["namespaces"].items()):
        table.add_row(ns, f"{d['entries']:,}", f"{d['tokens']:,}", _human_bytes(d["bytes"]))
    table.add_row(
        "[b]total",
        f"{result['entries']:,}",
        f"{result['tokens']:,}",
        _human_bytes(result["entry_bytes"]),
    )
    console.print(table)
    line = f"sessions {result['sessions']:,}"
    if "objects" in result:
        line += f"   objects {result['objects']:,} ({_human_bytes(result['object_bytes'])})"
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
    _config(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    exporter = StatsExporter(lambda: collect_stats(args, show=False), args.interval)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: exporter.stop())
    exporter.serve(host, port)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    rows = []
    with _open_index(args) as index:
        for rec in index.iter_entries(args.ns):
            rows.append(rec)
            if args.limit and len(rows) >= args.limit:
                break
    rows.sort(key=lambda r: (r.ns, -r.entry.created))
    if args.json:
        _emit_json(
            [
                {
                    "ns": r.ns,
                    "fp": r.fp,
                    "object_key": r.entry.object_key,
                    "tokens": r.entry.n_tokens,
                    "size": r.entry.size,
                    "created": r.entry.created,
                    "expires_at": r.expires_at,
                }
                for r in rows
            ]
        )
        return 0
    table = Table("namespace", "fingerprint", "tokens", "size", "age", "object")
    now = time.time()
    for r in rows:
        table.add_row(
            r.ns[:12],
            r.fp[:16],
            str(r.entry.n_tokens),
            _human_bytes(r.entry.size),
            f"{max(0.0, now - r.entry.created):.0f}s",
            r.entry.object_key,
        )
    Console().print(table)
    return 0


def _describe_object(store: ObjectStore, key: str) -> dict[str, Any]:
    data = store.get(key)
    header, offset = read_header(data)
    digest_ok = digest_matches(data, digest_from_key(key))
    return {
        "key": key,
        "size": len(data),
        "digest_ok": digest_ok,
        "header": header.to_dict(),
        "payload_offset": offset,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    target = args.target.strip()
    result: dict[str, Any] = {}
    if _FP_RE.match(target):
        with _open_index(args) as index:
            recs = [r for r in index.iter_entries(args.ns) if r.fp == target]
        if not recs:
            raise KVCloudError(f"no index entry for fingerprint {target[:16]}…")
        result["entries"] = [
            {
                "ns": r.ns,
                "fp": r.fp,
                "object_key": r.entry.object_key,
                "tokens": r.entry.n_tokens,
                "size": r.entry.size,
                "created": r.entry.created,
                "expires_at": r.expires_at,
            }
            for r in recs
        ]
        keys = [k for r in recs for k in r.entry.keys]  # a chunk's parts, each
    elif "/" in target:
        keys = [target]
    else:
        raise KVCloudError("inspect takes an object key (ns/ab/abcd…) or a 64-hex fingerprint")
    with _open_store(args) as store:
        objects = []
        for key in keys:
            try:
                objects.append(_describe_object(store, key))
            except ObjectNotFoundError:
                objects.append({"key": key, "error": "object not found"})
            except CorruptObjectError as exc:
                # a finding about the object; a store that cannot be read at all is not,
                # and fails the command with its own one-line error
                objects.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
    result["objects"] = objects
    if args.json:
        _emit_json(result)
    else:
        console = Console()
        for e in result.get("entries", []):
            console.print(
                f"entry  ns={e['ns']} fp={e['fp']} tokens={e['tokens']} "
                f"size={e['size']:,} object={e['object_key']}"
            )
        for o in objects:
            if "error" in o:
                console.print(f"object {o['key']}: [red]{o['error']}")
                continue
            console.print(
                f"object {o['key']}  {o['size']:,} bytes  digest "
                f"{'ok' if o['digest_ok'] else '[red]MISMATCH'}"
            )
            for k, v in o["header"].items():
                console.print(f"  {k:12} {v}")
    bad = any("error" in o or not o.get("digest_ok") for o in objects)
    return 1 if bad else 0


# --- verify and gc (logic in maintenance.py) ------------------------------------------------


class _RichProgress:
    """Adapts maintenance's ``progress(phase, advance, total)`` to a rich Progress: one
    line per phase, with a bar once the phase knows its total."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, phase: str, advance: int, total: int | None) -> None:
        task = self.tasks.get(phase)
        if task is None:
            task = self.tasks[phase] = self.progress.add_task(phase, total=total)
        elif total is not None:
            self.progress.update(task, total=total)
        self.progress.advance(task, advance)


def _maintenance_progress(enabled: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,}"),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )


_PROBLEMS_SHOWN = 20


def cmd_verify(args: argparse.Namespace) -> int:
    from .maintenance import verify

    show = not args.json and sys.stderr.isatty()
    with (
        _open_store(args) as store,
        _open_index(args) as index,
        _maintenance_progress(show) as progress,
    ):
        report = verify(
            store, index, deep=args.deep, repair=args.repair, progress=_RichProgress(progress)
        )
        urls = {"store": store.url, "index": index.url}
    if args.json:
        _emit_json({**urls, **report.to_dict()})
    else:
        r = report
        console = Console(highlight=False, soft_wrap=True)
        console.print(
            f"entries   {r.entries_checked:,} checked{' (deep)' if r.deep else ''}: "
            f"{r.entries_ok:,} ok, {r.missing:,} missing, {r.wrong_size:,} wrong size, "
            f"{r.corrupt:,} corrupt"
        )
        console.print(
            f"sessions  {r.sessions_checked:,} checked: {r.sessions_ok:,} ok, "
            f"{r.sessions_broken:,} broken ({r.sessions_unreadable:,} unreadable)"
        )
        console.print(
            f"objects   {r.objects:,} ({_human_bytes(r.object_bytes)}), "
            f"{r.orphans:,} orphans ({_human_bytes(r.orphan_bytes)}, reclaimable by gc)"
            + (f", {r.foreign_objects:,} foreign keys ignored" if r.foreign_objects else "")
        )
        for p in r.problems[:_PROBLEMS_SHOWN]:
            where = f"session {p.session}" if p.session else f"entry {(p.fp or '')[:16]}"
            console.print(f"  [red]{p.kind}[/red]  {where}  {p.object_key or ''}  {p.detail}")
        if len(r.problems) > _PROBLEMS_SHOWN:
            console.print(f"  … and {len(r.problems) - _PROBLEMS_SHOWN:,} more (see --json)")
        if r.repair:
            console.print(
                f"repair    dropped {r.entries_dropped:,} entries, deleted "
                f"{r.objects_deleted:,} corrupt objects; session records are never deleted"
            )
        console.print("[green]clean" if r.clean else "[red]problems found")
    return 0 if report.clean else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from .maintenance import gc, parse_duration, parse_size

    grace = parse_duration(args.grace)
    max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes)
    settle = None if args.settle is None else parse_duration(args.settle)
    show = not args.json and sys.stderr.isatty()
    with (
        _open_store(args) as store,
        _open_index(args) as index,
        _maintenance_progress(show) as progress,
    ):
        report = gc(
            store,
            index,
            grace_seconds=grace,
            max_bytes=max_bytes,
            dry_run=args.dry_run,
            progress=_RichProgress(progress),
            settle_seconds=settle,
        )
        urls = {"store": store.url, "index": index.url}
    if args.json:
        _emit_json({**urls, **report.to_dict()})
        return 0
    r = report
    would = "would " if r.dry_run else ""
    drop, delete, free = (
        ("would drop", "would delete", "would free")
        if r.dry_run
        else ("dropped", "deleted", "freed")
    )
    console = Console(highlight=False, soft_wrap=True)
    console.print(
        f"objects   {r.objects:,} ({_human_bytes(r.object_bytes)}); {r.entries:,} entries and "
        f"{r.sessions:,} sessions; {r.referenced_objects:,} objects {would}stay referenced"
    )
    if r.max_bytes is not None:
        console.print(
            f"trim      referenced {_human_bytes(r.referenced_bytes_before)} > "
            f"budget {_human_bytes(r.max_bytes)}: {drop} {r.entries_dropped:,} "
            f"least-recently-used entries ({_human_bytes(r.entry_bytes_dropped)})"
            if r.entries_dropped or r.over_budget
            else f"trim      referenced {_human_bytes(r.referenced_bytes_before)} fits "
            f"budget {_human_bytes(r.max_bytes)}"
        )
        if r.over_budget:
            console.print("          [yellow]still over budget: session records need the rest")
    if r.skipped:
        console.print(f"[yellow]skipped   {r.skipped}")
    else:
        console.print(
            f"delete    {delete} {r.objects_deleted:,} unreferenced objects, "
            f"{free} {_human_bytes(r.bytes_freed)}; kept {r.kept_young + r.kept_touched:,}"
            f" younger than the grace period ({args.grace})"
        )
    if r.dangling_dropped or r.sessions_damaged:
        console.print(
            f"race      {r.dangling_dropped:,} entries registered during the delete were "
            f"dropped; {r.sessions_damaged:,} session records lost an object"
        )
    return 0


# --- doctor --------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import FAIL, WARN, run_doctor

    cfg = _config(args)
    # Neither flag given: check both configured backends. One given: only that side.
    both = args.store is None and args.index is None
    store_url = cfg.store if both or args.store is not None else None
    index_url = cfg.index if both or args.index is not None else None
    checks = run_doctor(store_url, index_url, cfg)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        _emit_json({"ok": not failed, "checks": [c.to_dict() for c in checks]})
    else:
        colors = {FAIL: "red", WARN: "yellow"}
        console = Console(highlight=False, soft_wrap=True)
        for c in checks:
            color = colors.get(c.status, "green")
            console.print(f"[{color}]{c.status:4}[/{color}] " + c.line()[5:], markup=True)
    return 1 if failed else 0


# --- bench ---------------------------------------------------------------------------------


def cmd_bench_store(args: argparse.Namespace) -> int:
    # imported here: the bench is a tool, not something every CLI start should load
    from .bench import BenchLayout, run_store_bench

    layout = BenchLayout.resolve(
        args.model,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        chunk_tokens=args.chunk_tokens,
    )
    err = Console(stderr=True)
    r = run_store_bench(
        args.store,
        args.index,
        servers=args.servers,
        layout=layout,
        chunks=args.chunks,
        concurrency=args.concurrency,
        repeat=args.repeat,
        pull_passes=args.pull_passes,
        lookup_chunks=args.lookup_chunks,
        lookup_iters=args.lookup_iters,
        codec=args.codec,
        keep=args.keep,
        progress=lambda msg: err.print(f"[dim]bench store: {msg}"),
        encrypt=args.encrypt,
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=2, sort_keys=True)
            f.write("\n")
    if args.json:
        _emit_json(r)
        return 0
    lay = r["layout"]
    console = Console()
    console.print(f"store  {r['store']}\nindex  {r['index']}", soft_wrap=True)
    console.print(
        f"{r['chunks']} chunks × {_human_bytes(lay['object_bytes'])} "
        f"({lay['model']}: {lay['layers']} layers, {lay['kv_heads']} kv heads, head_dim "
        f"{lay['head_dim']}, {lay['dtype']}, {lay['chunk_tokens']} tokens, codec {lay['codec']})"
        f", concurrency {r['concurrency']}, best and median of {r['repeat']} pushes and "
        f"{r['repeat'] * r.get('pull_passes', 1)} pulls",
        soft_wrap=True,
    )
    t = Table("", "method", "GB/s best", "GB/s med", "ratio best", "ratio med")
    rows = [  # (transfer, label, figures, the pair its ratio comes from)
        ("push", "kvcloud push", r["push"]["kvcloud"], r["push"]),
        ("", r["push"]["baseline"]["method"], r["push"]["baseline"], None),
        ("pull", "kvcloud → pages", r["pull"]["kvcloud"], r["pull"]),
        ("", "kvcloud → array", r["pull_array"]["kvcloud"], r["pull_array"]),
        ("", r["pull"]["baseline"]["method"], r["pull"]["baseline"], None),
    ]
    enc = r.get("encryption")
    if enc:  # --encrypt: each under its unencrypted row, ratio vs the same plain baseline
        rows.insert(
            1, ("", "kvcloud push, encrypted", enc["push"]["kvcloud"], enc["push_vs_baseline"])
        )
        rows.insert(
            4, ("", "kvcloud → pages, encrypted", enc["pull"]["kvcloud"], enc["pull_vs_baseline"])
        )
        rows.insert(
            6,
            (
                "",
                "kvcloud → array, encrypted",
                enc["pull_array"]["kvcloud"],
                enc["pull_array_vs_baseline"],
            ),
        )
    for op, label, x, pair in rows:
        t.add_row(
            op,
            label,
            f"{x['gbps_best']:.3f}",
            f"{x['gbps_median']:.3f}",
            f"{pair['ratio_best']:.2f}×" if pair else "1",
            f"{pair['ratio_median']:.2f}×" if pair else "1",
        )
    console.print(t)
    if enc:
        console.print(
            f"encryption ({enc['alg']}) vs unencrypted kvcloud, median: push "
            f"{enc['push']['ratio_median']:.2f}× ({enc['push_overhead_pct']:+.0f}% time), pull "
            f"{enc['pull']['ratio_median']:.2f}× ({enc['pull_overhead_pct']:+.0f}%), pull → array "
            f"{enc['pull_array']['ratio_median']:.2f}× ({enc['pull_array_overhead_pct']:+.0f}%)"
        )
    lk = r["lookup"]
    t = Table(f"{lk['chunks']}-chunk lookup, {lk['iters']}×", "p50 ms", "p99 ms", "mean ms")
    for name in ("kvcloud", "fingerprints", "index_lookup_run", "ping"):
        x = lk[name]
        t.add_row(
            x["method"].replace("KVCloud.", "kvcloud "),
            f"{x['p50_ms']:.3f}",
            f"{x['p99_ms']:.3f}",
            f"{x['mean_ms']:.3f}",
        )
    console.print(t)
    mem = r.get("index_memory")
    if mem:
        console.print(
            f"redis {mem['redis_version']}: {mem['entries']:,} entries, "
            f"{mem['bytes_per_entry']:.1f} B/entry ({mem['buckets']} buckets per namespace)"
        )
    console.print(
        f"lookup/ping: p50 {lk['ratio_p50']:.2f}×, p99 {lk['ratio_p99']:.2f}×   "
        + (
            "kept the bench's objects and entries (--keep)"
            if r["cleanup"]["kept"]
            else f"cleaned up {r['cleanup']['objects_deleted']} objects, "
            f"{r['cleanup']['entries_dropped']} entries"
        )
    )
    return 0


# --- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcloud", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"kvcloud {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def backend(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--store", help="object store URL (default: $KVCLOUD_STORE)")
        sp.add_argument("--index", help="index URL (default: $KVCLOUD_INDEX)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    e = sub.add_parser("estimate", help="KV size of a prefix (the seed's formula)")
    e.add_argument("--layers", type=int)
    e.add_argument("--tokens", type=int, required=True)
    e.add_argument("--kv-dim", type=int, help="kv_heads × head_dim")
    e.add_argument("--bytes-per-element", type=float)
    e.add_argument("--dtype", help="instead of --bytes-per-element: " + ", ".join(DTYPES))
    e.add_argument("--model", help="take the shape from a preset: " + ", ".join(KV_SHAPES))
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)

    s = sub.add_parser("stats", help="entries, bytes, sessions and counters")
    backend(s)
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

    ls = sub.add_parser("ls", help="list index entries")
    backend(ls)
    ls.add_argument("--ns", help="only this namespace id")
    ls.add_argument("--limit", type=int, default=0)
    ls.set_defaults(func=cmd_ls)

    ins = sub.add_parser("inspect", help="show an object's header, or a fingerprint's entry")
    backend(ins)
    ins.add_argument("target", metavar="KEY|FP")
    ins.add_argument("--ns", help="with a fingerprint: only this namespace id")
    ins.set_defaults(func=cmd_inspect)

    ver = sub.add_parser(
        "verify",
        help="check every entry and session record against the store (exit 1 on problems)",
    )
    backend(ver)
    ver.add_argument(
        "--deep", action="store_true", help="download, re-hash and decode every object"
    )
    ver.add_argument(
        "--repair",
        action="store_true",
        help="drop bad entries (with --deep, also delete objects failing their digest); "
        "session records are reported, never deleted",
    )
    ver.set_defaults(func=cmd_verify)

    g = sub.add_parser(
        "gc", help="trim least-recently-used entries, delete old unreferenced objects"
    )
    backend(g)
    g.add_argument(
        "--grace",
        default="1h",
        help="keep unreferenced objects younger than this (30s, 15m, 2h, 1d; default 1h)",
    )
    g.add_argument(
        "--max-bytes",
        metavar="SIZE",
        help="drop least-recently-used entries until referenced objects fit (500MB, 2GiB)",
    )
    g.add_argument(
        "--settle",
        metavar="DURATION",
        help="after deleting, look this long for entries in-flight pushes register for "
        "deleted objects, and drop them (default: the grace period, at most 15s)",
    )
    g.add_argument("--dry-run", action="store_true", help="change nothing, report what would")
    g.set_defaults(func=cmd_gc)

    doc = sub.add_parser(
        "doctor", help="check the store and index end to end and say what to fix (exit 1 on FAIL)"
    )
    backend(doc)
    doc.set_defaults(func=cmd_doctor)

    bench = sub.add_parser("bench", help="benchmarks against your own deployment")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser(
        "store",
        help="push/pull throughput and lookup latency next to a plain client of the same bytes",
    )
    bs.add_argument("--store", help="object store URL (default: $KVCLOUD_STORE)")
    bs.add_argument("--index", help="index URL (default: $KVCLOUD_INDEX)")
    bs.add_argument(
        "--servers",
        action="store_true",
        help="start a local moto_server and redis-server for the run instead",
    )
    bs.add_argument(
        "--model", default="small", help="segment layout preset: " + ", ".join(KV_SHAPES)
    )
    bs.add_argument("--layers", type=int, help="override the preset's layers")
    bs.add_argument("--kv-heads", type=int, help="override the preset's KV heads")
    bs.add_argument("--head-dim", type=int, help="override the preset's head_dim")
    bs.add_argument("--dtype", choices=sorted(DTYPES), help="override the preset's dtype")
    bs.add_argument("--chunk-tokens", type=int, default=256, help="tokens per segment")
    bs.add_argument("--chunks", type=int, default=64, help="segments per round (default 64)")
    bs.add_argument(
        "--concurrency",
        type=int,
        help="parallel transfers, both sides (default: $KVCLOUD_MAX_CONNECTIONS or 16)",
    )
    bs.add_argument("--repeat", type=int, default=3, help="measured rounds (best and median)")
    bs.add_argument(
        "--pull-passes",
        type=int,
        default=3,
        help="pulls of each method per round, order rotating (more samples, same bytes)",
    )
    bs.add_argument("--lookup-chunks", type=int, default=128, help="chunks per lookup prompt")
    bs.add_argument("--lookup-iters", type=int, default=2000, help="timed lookups")
    bs.add_argument("--codec", choices=("raw", "zstd", "lz4"), help="default: $KVCLOUD_CODEC")
    bs.add_argument("--keep", action="store_true", help="leave the bench's objects and entries")
    bs.add_argument(
        "--encrypt",
        action="store_true",
        help="also push and pull for an encrypting tenant (AES-256-GCM), same run: the overhead",
    )
    bs.add_argument("--json", action="store_true", help="print JSON instead of tables")
    bs.add_argument("--json-out", metavar="PATH", help="also write the JSON to PATH")
    bs.set_defaults(func=cmd_bench_store)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KVCloudError as exc:
        print(f"kvcloud {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
