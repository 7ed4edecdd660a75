"""Index figures: the latency of a whole-prompt lookup next to one ping, and Redis memory per
entry.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...client import KVCloud
from ...indexes.base import Index, IndexEntry
from ...namespace import Namespace
from ...segment import content_digest, object_key
from .figures import latency_figures
from .layout import BenchError


def lookup_bench(kv: KVCloud, ns: Namespace, n_chunks: int, iters: int) -> dict[str, Any]:
    """Latency of a lookup of an n-chunk prompt (all hits) next to one ping, interleaved.

    ``kvcloud`` is what a request pays: ``KVCloud.lookup`` from token ids (fingerprints, the
    index call, decoding the reply); ``fingerprints`` and ``index_lookup_run`` are its two
    parts alone."""
    rng = np.random.default_rng()
    tokens = rng.integers(0, 50_000, size=n_chunks * ns.chunk_tokens, dtype=np.int64)
    fps = kv.fingerprints(ns, tokens)
    now = time.time()
    kv.index.register_many(
        ns.id,
        [
            # Entries only: a lookup never touches the objects they name.
            (fp.hex(), IndexEntry(object_key(ns.id, content_digest(fp)), ns.chunk_tokens, 1, now))
            for fp in fps
        ],
    )
    hexes = [fp.hex() for fp in fps]
    index: Index = kv.index
    m = kv.lookup(ns, tokens)
    if len(m.chunks) != n_chunks:
        raise BenchError(f"lookup found {len(m.chunks)} of {n_chunks} registered chunks")

    calls: dict[str, Callable[[], object]] = {
        "kvcloud": lambda: kv.lookup(ns, tokens),
        "fingerprints": lambda: kv.fingerprints(ns, tokens),
        "index_lookup_run": lambda: index.lookup_run(ns.id, hexes),
        "ping": index.ping,
    }
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    warm = max(5, iters // 10)
    for it in range(warm + iters):
        # rotate the order so no method always runs right after another one
        for j in range(len(names)):
            name = names[(it + j) % len(names)]
            t0 = time.perf_counter()
            calls[name]()
            dt = time.perf_counter() - t0
            if it >= warm:
                samples[name].append(dt)
    figures = {name: latency_figures(s) for name, s in samples.items()}
    figures["kvcloud"]["method"] = "KVCloud.lookup (token ids)"
    figures["fingerprints"]["method"] = "KVCloud.fingerprints"
    figures["index_lookup_run"]["method"] = f"{type(index).__name__}.lookup_run"
    figures["ping"]["method"] = f"{type(index).__name__}.ping"
    return {
        "chunks": n_chunks,
        "iters": iters,
        **figures,
        "ratio_p50": figures["kvcloud"]["p50_ms"] / figures["ping"]["p50_ms"],
        "ratio_p99": figures["kvcloud"]["p99_ms"] / figures["ping"]["p99_ms"],
        "index_ratio_p50": figures["index_lookup_run"]["p50_ms"] / figures["ping"]["p50_ms"],
        "index_ratio_p99": figures["index_lookup_run"]["p99_ms"] / figures["ping"]["p99_ms"],
    }


def index_memory_bench(index: Index, ns_id: str, n: int) -> dict[str, Any] | None:
    """Redis memory per entry: register n entries (standard object keys, as a worker
    writes them) under namespace ``ns_id`` in batches of 1,000 and divide the INFO
    used_memory delta by n. Only on a redis-server the bench started itself, which nothing
    else writes to and which is thrown away with these entries."""
    if type(index).__name__ != "RedisIndex":
        return None
    client = index._client  # type: ignore[attr-defined]  # the same server and database
    before = int(client.info("memory")["used_memory"])
    now = time.time()
    for start in range(0, n, 1000):
        batch = []
        for i in range(start, min(n, start + 1000)):
            fp = hashlib.sha256(b"mem" + i.to_bytes(8, "big")).digest()
            key = object_key(ns_id, content_digest(fp))
            batch.append((fp.hex(), IndexEntry(key, 256, 33_554_944, now)))
        index.register_many(ns_id, batch)
    after = int(client.info("memory")["used_memory"])
    info = client.info("server")
    return {
        "entries": n,
        "buckets": getattr(index, "buckets", None),
        "used_memory_before": before,
        "used_memory_after": after,
        "bytes_per_entry": (after - before) / n,
        "redis_version": info.get("redis_version"),
    }
