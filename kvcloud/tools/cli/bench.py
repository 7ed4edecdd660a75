"""``kvcloud bench store``: a thin wrapper around :func:`kvcloud.tools.bench.run_store_bench`
that prints its figures as tables or JSON.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ...models import KV_SHAPES
from ...namespace import DTYPES
from .common import emit_json, human_bytes


def cmd_bench_store(args: argparse.Namespace) -> int:
    # imported here: the bench is a tool, not something every CLI start should load
    from ..bench import BenchLayout, run_store_bench

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
        emit_json(r)
        return 0
    lay = r["layout"]
    console = Console()
    console.print(f"store  {r['store']}\nindex  {r['index']}", soft_wrap=True)
    console.print(
        f"{r['chunks']} chunks × {human_bytes(lay['object_bytes'])} "
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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
