"""The ``kvcloud`` command line: estimate, size, stats, ls, inspect, verify, gc, bench, doctor.

Every command takes ``--json`` for scripts. Backend commands take ``--store``/``--index``
(default: KVCLOUD_STORE / KVCLOUD_INDEX). Errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ... import __version__
from ...errors import KVCloudError
from . import bench, doctor, estimate, maintenance, objects, size, stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcloud", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"kvcloud {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    # the order of the commands in --help
    for area in (estimate, size, stats, objects, maintenance, doctor, bench):
        area.add_parsers(sub)
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
