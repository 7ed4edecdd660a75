"""The kvcloud command line: estimate, size, stats, ls, inspect, verify, gc, bench, doctor.

Every command takes ``--json`` for scripts. Backend commands take ``--store``/``--index``
(default: KVCLOUD_STORE / KVCLOUD_INDEX), say on stderr which ones they used, and never
create a store or an index. Errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ... import __version__
from ...errors import KVCloudError
from . import bench, doctor, estimate, maintenance, objects, size, stats
from .common import print_used_backends

EPILOG = """\
store and index: --store/--index, else KVCLOUD_STORE/KVCLOUD_INDEX, else a private
file:// store and sqlite:// index under ~/.cache/kvcloud. When a command has run, it names
on stderr the ones it used and where they came from ("kvcloud: store URL (source) · index
URL (source)"; with --json, the JSON holds them). Commands other than bench never create a
store or an index: a file:// directory or sqlite:// file that does not exist is an error
("no index at ..."), not a new empty one.

exit status:
  0  healthy, or everything found was repaired (verify --repair)
  1  problems found and left: verify, inspect (a bad object), doctor (a FAIL line)
  2  usage or configuration error: a bad flag or URL, an unreachable or refusing
     server, a missing store, index or bucket (doctor reports those as FAIL lines);
     one line on stderr, "kvcloud COMMAND: error: ..."
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcloud",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvcloud {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    # the order of the commands in --help
    for area in (estimate, size, stats, objects, maintenance, doctor, bench):
        area.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = int(args.func(args))
        print_used_backends(args)
        return rc
    except KVCloudError as exc:
        print(f"kvcloud {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
