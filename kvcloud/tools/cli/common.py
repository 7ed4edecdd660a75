"""What every command shares: opening the configured store and index, the backend flags,
human-readable sizes and JSON output.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ...config import KVCloudConfig
from ...indexes.base import Index
from ...stores.base import ObjectStore


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


def open_backend_index(args: argparse.Namespace) -> Index:
    return backend_config(args).open_index()


def open_backend_store(args: argparse.Namespace) -> ObjectStore:
    return backend_config(args).open_store()


def add_backend_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--store", help="object store URL (default: $KVCLOUD_STORE)")
    sp.add_argument("--index", help="index URL (default: $KVCLOUD_INDEX)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
