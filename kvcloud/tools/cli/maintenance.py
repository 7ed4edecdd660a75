"""``kvcloud verify`` and ``kvcloud gc``: thin wrappers around ``kvcloud.tools.verify.verify``
and ``kvcloud.tools.gc.gc``, with a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn

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


class _RichProgress:
    """Adapts verify's and gc's ``progress(phase, advance, total)`` to a rich Progress: one
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
    from ..verify import verify

    announce(args, backend_config(args))
    show = not args.json and sys.stderr.isatty()
    with (
        open_backend_store(args) as store,
        open_backend_index(args) as index,
        _maintenance_progress(show) as progress,
    ):
        report = verify(
            store, index, deep=args.deep, repair=args.repair, progress=_RichProgress(progress)
        )
        urls = {"store": store.url, "index": index.url, "sources": backend_sources(args)}
    left = problems_left(report)
    if args.json:
        emit_json({**urls, **report.to_dict(), "problems_left": left})
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
            f"objects   {r.objects:,} ({human_bytes(r.object_bytes)}), "
            f"{r.orphans:,} orphans ({human_bytes(r.orphan_bytes)}, reclaimable by gc)"
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
        if r.clean:
            console.print("[green]clean")
        elif not left:
            console.print("[green]repaired: no problem left")
        else:
            console.print(
                f"[red]problems found: {left:,} left"
                + ("" if r.repair else " (--repair drops the bad entries)")
            )
    return 1 if left else 0


def problems_left(report: Any) -> int:
    """What verify found and did not fix: everything without ``--repair``; with it, the
    broken session records (repair drops every bad entry, or finds it fixed meanwhile, but
    never deletes a session record: it holds the only copy of a conversation's tokens)."""
    if report.repair:
        return int(report.sessions_broken)
    return int(report.missing + report.wrong_size + report.corrupt + report.sessions_broken)


def cmd_gc(args: argparse.Namespace) -> int:
    from ..gc import gc, parse_duration, parse_size

    grace = parse_duration(args.grace)
    max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes)
    settle = None if args.settle is None else parse_duration(args.settle)
    announce(args, backend_config(args))
    show = not args.json and sys.stderr.isatty()
    with (
        open_backend_store(args) as store,
        open_backend_index(args) as index,
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
        urls = {"store": store.url, "index": index.url, "sources": backend_sources(args)}
    if args.json:
        emit_json({**urls, **report.to_dict()})
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
        f"objects   {r.objects:,} ({human_bytes(r.object_bytes)}); {r.entries:,} entries and "
        f"{r.sessions:,} sessions; {r.referenced_objects:,} objects {would}stay referenced"
    )
    if r.max_bytes is not None:
        console.print(
            f"trim      referenced {human_bytes(r.referenced_bytes_before)} > "
            f"budget {human_bytes(r.max_bytes)}: {drop} {r.entries_dropped:,} "
            f"least-recently-used entries ({human_bytes(r.entry_bytes_dropped)})"
            if r.entries_dropped or r.over_budget
            else f"trim      referenced {human_bytes(r.referenced_bytes_before)} fits "
            f"budget {human_bytes(r.max_bytes)}"
        )
        if r.over_budget:
            console.print("          [yellow]still over budget: session records need the rest")
    if r.skipped:
        console.print(f"[yellow]skipped   {r.skipped}")
    else:
        console.print(
            f"delete    {delete} {r.objects_deleted:,} unreferenced objects, "
            f"{free} {human_bytes(r.bytes_freed)}; kept {r.kept_young + r.kept_touched:,}"
            f" younger than the grace period ({args.grace})"
        )
    if r.dangling_dropped or r.sessions_damaged:
        console.print(
            f"race      {r.dangling_dropped:,} entries registered during the delete were "
            f"dropped; {r.sessions_damaged:,} session records lost an object"
        )
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ver = sub.add_parser(
        "verify",
        help="check every entry and session record against the store (exit 1 on problems "
        "left, 0 when clean or all repaired)",
    )
    add_backend_args(ver)
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
    add_backend_args(g)
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
