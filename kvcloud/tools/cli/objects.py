"""``kvcloud ls`` and ``kvcloud inspect``: list index entries, show an object's header or a
fingerprint's entry.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from ...errors import CorruptObjectError, KVCloudError, ObjectNotFoundError
from ...indexes.base import EntryRecord, Index
from ...segment import digest_from_key, digest_matches, read_header
from ...stores.base import ObjectStore
from .common import (
    add_backend_args,
    announce,
    backend_config,
    emit_json,
    human_bytes,
    open_backend_index,
    open_backend_store,
    used_backends,
)

# a fingerprint, or a prefix of one as ``ls`` prints it (16 hex digits)
_MIN_FP_PREFIX = 8
_FP_RE = re.compile(rf"^[0-9a-f]{{{_MIN_FP_PREFIX},64}}$")
_NS_ID_CHARS = 32  # a namespace id's hex digits; fewer: a prefix, as ls prints it


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


def _entries(index: Index, ns: str | None) -> Iterator[EntryRecord]:
    """Entries of namespace ``ns``: a full id, or a prefix of one as ``ls`` prints it."""
    if ns is None or len(ns) >= _NS_ID_CHARS:
        yield from index.iter_entries(ns)
        return
    for rec in index.iter_entries():
        if rec.ns.startswith(ns):
            yield rec


def cmd_ls(args: argparse.Namespace) -> int:
    announce(args, backend_config(args), store=False)
    rows = []
    with open_backend_index(args) as index:
        for rec in _entries(index, args.ns):
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


def _find_fingerprint(index: Index, prefix: str, ns: str | None) -> list[EntryRecord]:
    """The entries whose fingerprint starts with ``prefix`` (``ls`` prints 16 hex digits); a
    KVCloudError when none does, or when the prefix fits several fingerprints."""
    recs = [r for r in _entries(index, ns) if r.fp.startswith(prefix)]
    fps = sorted({r.fp for r in recs})
    where = f" in namespace {ns}" if ns else ""
    if not fps:
        raise KVCloudError(f"no index entry for fingerprint {prefix[:16]}…{where}")
    if len(fps) > 1:
        shown = ", ".join(fp[:16] for fp in fps[:4]) + (", …" if len(fps) > 4 else "")
        raise KVCloudError(
            f"fingerprint prefix {prefix} is ambiguous: {len(fps)} fingerprints start with it "
            f"({shown}); give more hex digits (or --ns)"
        )
    return recs


def cmd_inspect(args: argparse.Namespace) -> int:
    target = args.target.strip()
    cfg = backend_config(args)
    by_fp = bool(_FP_RE.match(target.lower()))
    announce(args, cfg, index=by_fp)
    result: dict[str, Any] = used_backends(args, cfg, index=by_fp)
    if by_fp:
        with open_backend_index(args) as index:
            recs = _find_fingerprint(index, target.lower(), args.ns)
        result["entries"] = [_entry_json(r) for r in recs]
        keys = [k for r in recs for k in r.entry.keys]  # a chunk's parts, each
    elif "/" in target:
        keys = [target]
    else:
        raise KVCloudError(
            "inspect takes an object key (ns/ab/abcd…) or a fingerprint: its 64 hex digits, "
            f"or a prefix of at least {_MIN_FP_PREFIX} as ls prints it"
        )
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
    ls.add_argument("--ns", help="only this namespace (its id, or a prefix as ls prints it)")
    ls.add_argument("--limit", type=int, default=0, help="at most this many entries (0: all)")
    ls.set_defaults(func=cmd_ls)

    ins = sub.add_parser(
        "inspect",
        help="show an object's header, or a fingerprint's entry (exit 1 if an object is bad)",
    )
    add_backend_args(ins)
    ins.add_argument(
        "target",
        metavar="KEY|FP",
        help="an object key, or a fingerprint: 64 hex digits or a unique prefix (ls prints 16)",
    )
    ins.add_argument("--ns", help="with a fingerprint: only this namespace (id or prefix)")
    ins.set_defaults(func=cmd_inspect)
