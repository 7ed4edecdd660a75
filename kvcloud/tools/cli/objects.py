"""``kvcloud ls`` and ``kvcloud inspect``: list index entries, show an object's header or a
fingerprint's entry.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ...errors import CorruptObjectError, KVCloudError, ObjectNotFoundError
from ...indexes.base import EntryRecord
from ...segment import digest_from_key, digest_matches, read_header
from ...stores.base import ObjectStore
from .common import add_backend_args, emit_json, human_bytes, open_backend_index, open_backend_store

_FP_RE = re.compile(r"^[0-9a-f]{64}$")


def _entry_json(r: EntryRecord) -> dict[str, Any]:
    """An index entry as ``ls --json`` and ``inspect --json`` print it."""
    return {
        "ns": r.ns,
        "fp": r.fp,
        "object_key": r.entry.object_key,
        "tokens": r.entry.n_tokens,
        "size": r.entry.size,
        "created": r.entry.created,
        "expires_at": r.expires_at,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    rows = []
    with open_backend_index(args) as index:
        for rec in index.iter_entries(args.ns):
            rows.append(rec)
            if args.limit and len(rows) >= args.limit:
                break
    rows.sort(key=lambda r: (r.ns, -r.entry.created))
    if args.json:
        emit_json([_entry_json(r) for r in rows])
        return 0
    table = Table("namespace", "fingerprint", "tokens", "size", "age", "object")
    now = time.time()
    for r in rows:
        table.add_row(
            r.ns[:12],
            r.fp[:16],
            str(r.entry.n_tokens),
            human_bytes(r.entry.size),
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
        with open_backend_index(args) as index:
            recs = [r for r in index.iter_entries(args.ns) if r.fp == target]
        if not recs:
            raise KVCloudError(f"no index entry for fingerprint {target[:16]}…")
        result["entries"] = [_entry_json(r) for r in recs]
        keys = [k for r in recs for k in r.entry.keys]  # a chunk's parts, each
    elif "/" in target:
        keys = [target]
    else:
        raise KVCloudError("inspect takes an object key (ns/ab/abcd…) or a 64-hex fingerprint")
    with open_backend_store(args) as store:
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
        emit_json(result)
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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ls = sub.add_parser("ls", help="list index entries")
    add_backend_args(ls)
    ls.add_argument("--ns", help="only this namespace id")
    ls.add_argument("--limit", type=int, default=0)
    ls.set_defaults(func=cmd_ls)

    ins = sub.add_parser("inspect", help="show an object's header, or a fingerprint's entry")
    add_backend_args(ins)
    ins.add_argument("target", metavar="KEY|FP")
    ins.add_argument("--ns", help="with a fingerprint: only this namespace id")
    ins.set_defaults(func=cmd_inspect)
