"""`kvcloud-worker bench …`: the benchmark subcommands and their arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .codec import add_codec_parser
from .common import progress_log
from .costmodel import costmodel_markdown, run_costmodel_bench
from .decode import decode_markdown, run_decode_bench
from .suite import cmd_bench_suite
from .ttft import plot, print_table, run_ttft_bench

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


def _emit(report: dict[str, Any], args: argparse.Namespace) -> None:
    if getattr(args, "json_out", None):
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks: ttft, costmodel, decode, codec, suite")
    bsub = b.add_subparsers(dest="bench", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="small")
        p.add_argument("--chunk-tokens", type=int, default=256)
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.add_argument("--json-out", type=Path, help="also write the JSON report here")

    t = bsub.add_parser("ttft", help="TTFT: recompute vs restore vs naive, per prefix length")
    common(t)
    t.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    t.add_argument("--backends", default="file,servers", help="file and/or servers")
    t.add_argument("--repeat", type=_at_least_one, default=1)
    t.add_argument(
        "--restores",
        type=_at_least_one,
        default=9,
        help="timed restores per length and method (the median is reported)",
    )
    t.add_argument("--no-naive", action="store_true")
    t.add_argument("--plot", type=Path, help="write a PNG of TTFT vs prefix length")
    t.set_defaults(func=cmd_bench_ttft)

    c = bsub.add_parser("costmodel", help="a store throttled to --rate: restore or recompute?")
    common(c)
    c.add_argument("--prefix-tokens", type=int, default=256)
    c.add_argument("--rate", type=float, default=10e6, help="bytes/s while throttled")
    c.add_argument("--per-phase", type=int, default=6)
    c.set_defaults(func=cmd_bench_costmodel)

    d = bsub.add_parser("decode", help="decode tokens/s with the uploader idle vs busy")
    common(d)
    d.add_argument("--tokens", type=int, default=48)
    d.add_argument("--upload-pages", type=int, default=48)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--backend", default="file", choices=("file", "servers"))
    d.set_defaults(func=cmd_bench_decode)

    add_codec_parser(bsub)

    su = bsub.add_parser("suite", help="everything `make bench` runs; writes JSON, PNGs, tables")
    su.add_argument("--out", type=Path, default=Path("docs/bench"))
    su.add_argument("--model", default="small")
    su.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    su.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    su.set_defaults(func=cmd_bench_suite)


def _at_least_one(text: str) -> int:
    """argparse type: a count of runs, so 0 (a table of dashes) is refused up front."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def cmd_bench_ttft(args: argparse.Namespace) -> int:
    report = run_ttft_bench(
        [int(x) for x in args.lengths.split(",") if x],
        [x for x in args.backends.split(",") if x],
        model=args.model,
        repeat=args.repeat,
        chunk_tokens=args.chunk_tokens,
        naive=not args.no_naive,
        log=progress_log(args.json),
        restore_repeat=args.restores,
    )
    if args.plot:
        plot(report, args.plot)
    _emit(report, args)
    if not args.json:
        print_table(report)
    return 0


def cmd_bench_costmodel(args: argparse.Namespace) -> int:
    report = run_costmodel_bench(
        model=args.model,
        prefix_tokens=args.prefix_tokens,
        rate=args.rate,
        per_phase=args.per_phase,
        chunk_tokens=args.chunk_tokens,
        log=progress_log(args.json),
    )
    _emit(report, args)
    if not args.json:
        print(costmodel_markdown(report))
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    report = run_decode_bench(
        model=args.model,
        tokens=args.tokens,
        upload_pages=args.upload_pages,
        rounds=args.rounds,
        backend=args.backend,
        chunk_tokens=args.chunk_tokens,
        log=progress_log(args.json),
    )
    _emit(report, args)
    if not args.json:
        print(decode_markdown(report))
    return 0
