"""What every command shares: opening the configured store and index (never creating them),
saying which ones a command used and where their URLs came from, the backend flags,
human-readable sizes and JSON output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ...config import KVCloudConfig
from ...errors import ConfigError
from ...indexes import open_index
from ...indexes.base import Index
from ...probe import require_index, require_store
from ...stores.base import ObjectStore
from ...urls import redact_url

_ENV = {"store": "KVCLOUD_STORE", "index": "KVCLOUD_INDEX"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def backend_config(args: argparse.Namespace) -> KVCloudConfig:
    return KVCloudConfig.from_env(store=args.store, index=args.index)


def backend_sources(args: argparse.Namespace) -> dict[str, str]:
    """Where the store and index URLs come from: ``--store``, ``KVCLOUD_STORE``, or
    ``default: KVCLOUD_STORE unset`` (the private file:// and sqlite:// under ~/.cache)."""
    out = {}
    for role, var in _ENV.items():
        if getattr(args, role, None) is not None:
            out[role] = f"--{role}"
        elif os.environ.get(var):
            out[role] = var
        else:
            out[role] = f"default: {var} unset"
    return out


def announce(
    args: argparse.Namespace,
    cfg: KVCloudConfig,
    *,
    store: bool = True,
    index: bool = True,
    sources: dict[str, str] | None = None,
    now: bool = False,
) -> None:
    """The line naming the store and index this command used (redacted) and where each came
    from, ``kvcloud: store URL (KVCLOUD_STORE) · index URL (default: KVCLOUD_INDEX unset)``:
    ``main`` prints it on stderr when the command has run (``now``: at once), except with
    ``--json``, whose output holds the same. A failing command prints only its error line."""
    sources = sources or backend_sources(args)
    parts = [
        f"{role} {redact_url(getattr(cfg, role))} ({sources[role]})"
        for role, used in (("store", store), ("index", index))
        if used
    ]
    line = "kvcloud: " + " · ".join(parts) if parts else None
    if now and line:
        print(line, file=sys.stderr, flush=True)
    else:
        args.used_backends_line = line


def print_used_backends(args: argparse.Namespace) -> None:
    line = getattr(args, "used_backends_line", None)
    if line and not getattr(args, "json", False):
        print(line, file=sys.stderr, flush=True)


def used_backends(
    args: argparse.Namespace, cfg: KVCloudConfig, *, store: bool = True, index: bool = True
) -> dict[str, Any]:
    """The store and index (redacted) and their sources, for a command's JSON output."""
    roles = [role for role, used in (("store", store), ("index", index)) if used]
    sources = backend_sources(args)
    return {
        **{role: redact_url(getattr(cfg, role)) for role in roles},
        "sources": {role: sources[role] for role in roles},
    }


def _require(args: argparse.Namespace, role: str, check: Callable[[str], None], url: str) -> None:
    try:
        check(url)
    except ConfigError as exc:
        if getattr(args, role, None) is None and not os.environ.get(_ENV[role]):
            raise ConfigError(f"{exc}; {_ENV[role]} is unset, so this is the default") from None
        raise


def open_backend_index(
    args: argparse.Namespace, *, create: bool = False, no_touch: bool = False
) -> Index:
    """The configured index. Commands read an existing one: a ``sqlite://`` path that does
    not exist is an error ("no index at …"), never a new empty index. ``no_touch``: a Redis
    index's reads leave the keys' LRU/LFU clocks as they were (a ``no_touch`` option in the
    URL still wins)."""
    cfg = backend_config(args)
    if not create:
        _require(args, "index", require_index, cfg.index)
    return open_index(
        cfg.index,
        ttl_seconds=cfg.ttl_seconds,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        no_touch=no_touch,
    )


def open_backend_store(args: argparse.Namespace, *, create: bool = False) -> ObjectStore:
    """The configured store; like the index, an existing one unless ``create``."""
    cfg = backend_config(args)
    if not create:
        _require(args, "store", require_store, cfg.store)
    return cfg.open_store()


def add_backend_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--store", help="object store URL (default: $KVCLOUD_STORE)")
    sp.add_argument("--index", help="index URL (default: $KVCLOUD_INDEX)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
