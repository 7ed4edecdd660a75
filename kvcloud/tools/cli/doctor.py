"""``kvcloud doctor``: check the store and index end to end and say what to fix."""

from __future__ import annotations

import argparse

from rich.console import Console

from .common import add_backend_args, backend_config, emit_json


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..doctor import FAIL, WARN, run_doctor

    cfg = backend_config(args)
    # Neither flag given: check both configured backends. One given: only that side.
    both = args.store is None and args.index is None
    store_url = cfg.store if both or args.store is not None else None
    index_url = cfg.index if both or args.index is not None else None
    checks = run_doctor(store_url, index_url, cfg)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        emit_json({"ok": not failed, "checks": [c.to_dict() for c in checks]})
    else:
        colors = {FAIL: "red", WARN: "yellow"}
        console = Console(highlight=False, soft_wrap=True)
        for c in checks:
            color = colors.get(c.status, "green")
            console.print(f"[{color}]{c.status:4}[/{color}] " + c.line()[5:], markup=True)
    return 1 if failed else 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doc = sub.add_parser(
        "doctor", help="check the store and index end to end and say what to fix (exit 1 on FAIL)"
    )
    add_backend_args(doc)
    doc.set_defaults(func=cmd_doctor)
