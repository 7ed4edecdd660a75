"""file:// reads side by side: kvcloud's verified pull into pages, plain ``read()`` of each
object into new memory, kept until all are read (the baseline of ``kvcloud bench store``), and
plain ``readinto`` into memory that is already resident, as a worker's KV pages are.

One process, one ``file://`` store + ``sqlite://`` index in a temporary directory, the same
objects, every round running the three in turn (rotating which goes first), each with the
store's read threads (one per CPU). The gap between kvcloud and ``readinto`` is what verifying
every byte costs: both copy each byte once from the page cache, kvcloud also hashes it.

    PYTHONPATH=. .venv/bin/python scripts/bench/bench_file_read.py --chunks 8 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvcloud import KVCloud
from kvcloud.tools.bench import BenchLayout
from kvcloud.tools.bench.layout import fresh_chain, random_chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=8, help="256-token chunks of 3 MiB")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    n = args.chunks
    ns = BenchLayout.resolve("small").namespace("bench-file-read")
    with (
        tempfile.TemporaryDirectory() as tmp,
        KVCloud.open(store=f"file://{tmp}/objects", index=f"sqlite://{tmp}/index.db") as kv,
    ):
        chain = fresh_chain(ns, n)
        data = random_chunks(ns, n, seed=1)
        kv.push_chunks(ns, [(fp, p, a) for (fp, p), a in zip(chain, data, strict=True)])
        fps = [fp for fp, _ in chain]
        m = kv.lookup_fingerprints(ns, fps)
        paths = [Path(tmp, "objects", c.entry.object_key) for c in m.chunks]
        sizes = [p.stat().st_size for p in paths]
        pages = np.empty((n, *ns.kv_shape(ns.chunk_tokens)), dtype=ns.dtype_info.storage)
        pages.fill(0)  # resident, as a worker's KV pages are
        # readinto needs room for the whole object (header included): a buffer per chunk
        landing = [np.empty(size, dtype=np.uint8) for size in sizes]
        for buf in landing:
            buf.fill(0)
        threads = kv.store.max_workers  # the store's own read threads
        pool = ThreadPoolExecutor(max_workers=threads)

        def kvcloud_pull() -> None:
            res = kv.pull_into(kv.lookup_fingerprints(ns, fps), pages)
            if res.chunks != n:
                raise SystemExit(f"kvcloud pulled {res.chunks} of {n} chunks")

        def read_one(i: int) -> bytes:
            with open(paths[i], "rb", buffering=0) as f:
                return f.read()

        def plain_read() -> None:
            # kept, as a client keeps what it reads: dropping each object at once would let
            # the allocator hand the same cache-hot 3 MiB back to every read
            got = list(pool.map(read_one, range(n)))
            if sum(len(b) for b in got) != sum(sizes):
                raise SystemExit("plain read() came back short")

        def readinto_one(i: int) -> int:
            with open(paths[i], "rb", buffering=0) as f:
                return f.readinto(memoryview(landing[i]))

        def plain_readinto() -> None:
            if sum(pool.map(readinto_one, range(n))) != sum(sizes):
                raise SystemExit("plain readinto() came back short")

        methods: list[Callable[[], None]] = [kvcloud_pull, plain_read, plain_readinto]
        times: dict[str, list[float]] = {f.__name__: [] for f in methods}
        for f in methods:  # warm-up: threads started, files in the page cache
            f()
        for r in range(args.rounds):
            for f in methods[r % 3 :] + methods[: r % 3]:
                t0 = time.perf_counter()
                f()
                times[f.__name__].append(time.perf_counter() - t0)
        pool.shutdown()
    total = sum(sizes)
    print(f"{n} chunks, {total / 2**20:.1f} MiB, {threads} threads, {args.rounds} rounds")
    read = statistics.median(times["plain_read"])
    readinto = statistics.median(times["plain_readinto"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:15} median {med * 1e3:7.2f} ms  {total / med / 1e9:6.2f} GB/s  "
            f"ratio to read(): {read / med:.2f}x  to readinto(): {readinto / med:.2f}x"
        )


if __name__ == "__main__":
    main()
