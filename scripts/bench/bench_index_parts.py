"""Redis memory per chunk when a chunk is stored in parts (a tensor-parallel vLLM), measured.

A chunk the vLLM connector saves at TP 1 is one index entry, a value of at most 62 bytes that
stays in Redis's compact listpack encoding (docs/OPERATIONS.md). At TP > 1 the chunk is
stored as one object per head range (``kvcloud/integrations/vllm/shard.py``), and the index
holds, per chunk, one *part record* per part (``KVCloud.offer_part``: a single object key, kept
one TTL from its write) and the chunk's entry naming every part's key
(``IndexEntry.of_parts``: the keys joined, about 105 bytes each). That value is longer than
``hash-max-listpack-value`` (64), so its bucket becomes a full hash table. ``kvcloud size``
(kvcloud/tools/sizing.py) sizes Redis from these figures.

For each server and part count, a fresh server process (no persistence, default config,
kvcloud's default expiry layout for it: field TTL on Redis 8, value expiry on Redis 7),
``--chunks`` chunks registered with the values the connector writes (through
``register_many`` in batches of 1,000, not one call per part: the same fields and values),
``--buckets`` buckets; *bytes per chunk* is the ``INFO memory`` ``used_memory`` delta ÷ chunks.

    python scripts/bench/bench_index_parts.py --out docs/bench/index_parts.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import blake3
import redis

from kvcloud import Namespace
from kvcloud.indexes import IndexEntry, open_index
from kvcloud.segment import object_key, part_record_fp
from kvcloud.segment.digests import digest_string
from tests.servers import redis_family_version, start_redis

SERVERS = ("redis8", "redis7")
PARTS = (1, 2, 3, 4, 6, 8, 16)
HEADS = 48  # split evenly by every part count above
NS = Namespace(
    model="vllm/llama", num_layers=32, num_kv_heads=HEADS, head_dim=128, dtype="bfloat16"
)
PART_BYTES = 33_555_000 // 8  # fixed-width in the value: any size packs alike


def _key(seed: bytes) -> str:
    """A format 3 object key (``.b3l``), as the connector's objects have."""
    return object_key(NS.id, digest_string("blake3-layers", blake3.blake3(seed).hexdigest()))


def chunk_entries(i: int, parts: int, now: float) -> list[tuple[str, IndexEntry]]:
    """What the index holds for chunk ``i`` saved in ``parts`` head ranges: its entry, and
    at TP > 1 one record per part (``KVCloud.offer_part`` and ``register_parts``)."""
    fp = hashlib.sha256(i.to_bytes(8, "big")).digest()
    if parts == 1:
        return [(fp.hex(), IndexEntry(_key(fp), 256, PART_BYTES * 8, now))]
    w = HEADS // parts
    keys = [_key(fp + bytes([j])) for j in range(parts)]
    out = [
        (part_record_fp(fp, (j * w, (j + 1) * w)).hex(), IndexEntry(k, 256, PART_BYTES, now))
        for j, k in enumerate(keys)
    ]
    out.append((fp.hex(), IndexEntry.of_parts(keys, 256, PART_BYTES * parts, now)))
    return out


def measure(flavor: str, parts: int, chunks: int, buckets: int) -> dict[str, Any]:
    server = start_redis(Path(tempfile.mkdtemp()), flavor=flavor)
    try:
        client = redis.Redis.from_url(server.url)
        before = client.info("memory")["used_memory"]
        entries = 0
        with open_index(f"{server.url}?buckets={buckets}") as index:
            field_ttl = bool(getattr(index, "uses_field_ttl", lambda: False)())
            batch: list[tuple[str, IndexEntry]] = []
            for i in range(chunks):
                batch += chunk_entries(i, parts, time.time())
                if len(batch) >= 1000:
                    index.register_many(NS.id, batch)
                    entries += len(batch)
                    batch = []
            if batch:
                index.register_many(NS.id, batch)
                entries += len(batch)
        after = client.info("memory")["used_memory"]
        encodings = {client.object("encoding", k) for k in client.scan_iter("kvc:h:*", 1000)}
        return {
            "server": flavor,
            "version": redis_family_version(flavor),
            "field_ttl": field_ttl,
            "parts": parts,
            "chunks": chunks,
            "entries": entries,
            "buckets": buckets,
            "bytes_per_chunk": round((after - before) / chunks, 1),
            "bytes_per_entry": round((after - before) / entries, 1),
            "encodings": sorted(e.decode() for e in encodings),
        }
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=51_200)
    ap.add_argument("--buckets", type=int, default=1024)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for flavor in args.servers.split(","):
        for parts in PARTS:
            r = measure(flavor, parts, args.chunks, args.buckets)
            print(
                f"{r['server']} {r['version']} field_ttl={r['field_ttl']} parts={parts}: "
                f"{r['bytes_per_chunk']:.1f} B/chunk ({r['bytes_per_entry']:.1f} B/entry) "
                f"{r['encodings']}",
                flush=True,
            )
            results.append(r)
    if args.out:
        meta = {
            "when": time.strftime("%Y-%m-%d %H:%M"),
            "command": "scripts/bench/bench_index_parts.py " + " ".join(sys.argv[1:]),
        }
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
