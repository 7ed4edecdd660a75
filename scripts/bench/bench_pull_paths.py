"""S3 pull paths side by side: kvcloud into pages, kvcloud into one array, plain boto3 GETs.

One process, one local moto_server + redis-server (as `kvcloud bench store --servers`), the
same objects, every round running the three in turn (rotating which goes first), so a slow
second of this shared machine lands on all three alike. Prints the medians and the ratios to
the plain GETs, over more rounds and at other sizes than `kvcloud bench store` (9 pulls per
method, 64 chunks).

    PYTHONPATH=. .venv/bin/python scripts/bench/bench_pull_paths.py --chunks 32 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvcloud import KVCloud, Namespace
from kvcloud.tools.bench import local_servers
from kvcloud.tools.bench.baselines import plain_client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32, help="256-token chunks of 3 MiB")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    # the `small` layout of kvcloud bench store: 12 layers, 4 KV heads x 64, float16
    ns = Namespace(
        model="bench-pull-paths",
        revision="r1",
        num_layers=12,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        chunk_tokens=256,
    )
    c, n = ns.chunk_tokens, args.chunks
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, size=n * c, dtype=np.int64)
    kv_array = rng.integers(0, 1 << 16, size=ns.kv_shape(n * c), dtype=np.uint16).view(np.float16)
    with local_servers() as (store, index), KVCloud.open(store=store, index=index) as kv:
        kv.push(ns, tokens, kv_array)
        m = kv.lookup(ns, tokens)
        assert len(m.chunks) == n, "push did not store every chunk"
        pages = [np.empty(ns.kv_shape(c), dtype=np.float16) for _ in range(n)]
        out = np.empty(ns.kv_shape(n * c), dtype=np.float16)
        keys = [ref.entry.object_key for ref in m.chunks]
        plain = plain_client(kv.store)
        with ThreadPoolExecutor(kv.store.max_workers) as pool:
            methods: dict[str, Callable[[], object]] = {
                "kvcloud → pages": lambda: kv.pull_into(m, pages),
                "kvcloud → array": lambda: kv.pull_detailed(m, out=out),
                "plain GET": lambda: list(pool.map(plain.get, keys)),
            }
            names = list(methods)
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.rounds + 1):  # round 0 warms up
                for j in range(len(names)):
                    name = names[(r + j) % len(names)]
                    t0 = time.perf_counter()
                    methods[name]()
                    if r:
                        times[name].append(time.perf_counter() - t0)
        plain.close()
        if not np.array_equal(out.view(np.uint16), kv_array.view(np.uint16)):
            raise SystemExit("the array pull is not bit-exact")
    base = statistics.median(times["plain GET"])
    mib = n * ns.chunk_bytes / 2**20
    print(f"{n} chunks ({mib:.0f} MiB), {args.rounds} rounds, medians:")
    for name in names:
        med = statistics.median(times[name])
        print(f"  {name:16s} {med * 1e3:7.1f} ms   {base / med:.2f}x plain")


if __name__ == "__main__":
    main()
