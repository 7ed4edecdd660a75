"""Objects deleted, truncated, bit-flipped or swapped behind the workers' backs.

Writer A stores five-chunk prompts; then, while A and reader B run, one chunk of each prompt
is damaged in the S3 server directly (boto3, no kvcloud code). B must detect each on pull
(verify on read: digest = key, header = what was asked), count it, drop the bad entry,
restore only the valid chunks before it, recompute the rest and answer exactly like a worker
with no store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import boto3
import pytest

from kvcloud.indexes import IndexEntry, open_index
from kvcloud.segment import read_header
from kvcloud.stores import open_store
from tests.faults.conftest import (
    CHUNK,
    Reference,
    Worker,
    answer,
    body,
    s3_url,
    text,
    wait_for,
)
from tests.faults.report import Observation
from tests.s3_servers import S3Server

pytestmark = pytest.mark.integration

PROMPT_CHARS = 82  # + BOS: 5 full chunks, generation stays in the tail
N_CHUNKS = 5
# prompt number → (chunk damaged, how)
DAMAGE = {
    0: (2, "deleted"),
    1: (1, "truncated"),
    2: (3, "bit-flipped"),
    3: (2, "replaced by another valid object"),
    4: (1, "entry re-pointed at another valid object"),
}
CONTROL = 5  # untouched


def _chain(store_url: str, entries: dict[str, IndexEntry]) -> list[tuple[str, IndexEntry]]:
    """A prompt's (fp, entry) pairs in chunk order, from the parent links in the headers."""
    parent_of: dict[str, str] = {}
    with open_store(store_url) as store:
        for fp, e in entries.items():
            header, _ = read_header(store.get(e.object_key))
            assert header.fp.hex() == fp
            parent_of[fp] = header.parent.hex()
    order: list[str] = []
    (first,) = [fp for fp, parent in parent_of.items() if parent not in entries]
    child_of = {parent: fp for fp, parent in parent_of.items()}
    fp = first
    while True:
        order.append(fp)
        if fp not in child_of:
            break
        fp = child_of[fp]
    assert len(order) == len(entries)
    return [(fp, entries[fp]) for fp in order]


def test_tampered_objects_are_detected_dropped_and_recomputed(
    s3_server: S3Server,
    redis_url: str,
    spawn: Callable[..., Worker],
    reference: Reference,
    reliability: Observation,
) -> None:
    reliability.scenario = (
        "objects deleted, truncated, bit-flipped, replaced by another valid object, and an "
        "entry re-pointed at another valid object, out of band while workers run"
    )
    reliability.must = (
        "each is detected on pull and counted (kvcloud_worker_remote_fallbacks, the client's "
        "missing_objects / verify_failures / entries_dropped), its entry dropped, only the "
        "chunks before it restored, and the answer identical to a worker with no store"
    )
    prefix = f"faults-tamper-{time.monotonic_ns()}"
    store = s3_url(s3_server.endpoint, prefix)
    a = spawn("a", store, redis_url, write_policy="write-through")
    b = spawn("b", store, redis_url, write_policy="off")
    ns = a.health()["namespace"]
    prompts = [text(PROMPT_CHARS, 700 + i) for i in range(CONTROL + 1)]
    for p in prompts:
        reference.tokens(p)

    # A stores each prompt; the entries it adds are that prompt's chunks
    chains: list[list[tuple[str, IndexEntry]]] = []
    with open_index(redis_url) as index:
        seen: set[str] = set()
        for p in prompts:
            assert answer(a.complete(body(p))) == reference.tokens(p)

            def registered(known: set[str] = seen) -> bool:
                return len({r.fp for r in index.iter_entries(ns)} - known) == N_CHUNKS

            assert wait_for(registered, 30), "A did not register the prompt's chunks"
            now = {r.fp: r.entry for r in index.iter_entries(ns)}
            chains.append(_chain(store, {fp: e for fp, e in now.items() if fp not in seen}))
            seen |= set(now)
    assert all(len(c) == N_CHUNKS for c in chains)

    # the damage, done to the S3 server directly
    # a new session reads the server's credentials from the environment (boto3's default
    # session keeps the first ones it found)
    s3 = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1"
    )

    def s3_key(entry: IndexEntry) -> str:
        return f"{prefix}/{entry.object_key}"

    def raw(entry: IndexEntry) -> bytes:
        return s3.get_object(Bucket="kvcloud", Key=s3_key(entry))["Body"].read()

    def put(entry: IndexEntry, data: bytes) -> None:
        s3.put_object(Bucket="kvcloud", Key=s3_key(entry), Body=data)

    bad: dict[int, tuple[str, IndexEntry]] = {}
    for i, (j, how) in DAMAGE.items():
        fp, entry = chains[i][j]
        bad[i] = (fp, entry)
        if how == "deleted":
            s3.delete_object(Bucket="kvcloud", Key=s3_key(entry))
        elif how == "truncated":
            put(entry, raw(entry)[: entry.size // 2])
        elif how == "bit-flipped":
            data = bytearray(raw(entry))
            data[len(data) // 2] ^= 0x10  # one bit, in the middle of the KV payload
            put(entry, bytes(data))
        elif how == "replaced by another valid object":
            put(entry, raw(chains[i][0][1]))
        else:  # the entry now names a valid object of another chunk (its digest checks out)
            other = chains[i][N_CHUNKS - 1][1]
            with open_index(redis_url) as index:
                assert index.drop(ns, fp, entry.object_key)
                assert index.register(ns, fp, other)
            bad[i] = (fp, other)

    # B pulls every prompt
    observed: dict[str, Any] = {}
    fallback_total = 0.0
    for i, p in enumerate(prompts):
        before = b.metrics()["kvcloud_worker_remote_fallbacks_total"]
        out = b.complete(body(p))
        fallbacks = b.metrics()["kvcloud_worker_remote_fallbacks_total"] - before
        fallback_total += fallbacks
        assert answer(out) == reference.tokens(p), f"prompt {i}: wrong answer"
        k = out["kvcloud"]
        if i == CONTROL:
            assert k["tokens_remote"] == N_CHUNKS * CHUNK
            assert fallbacks == 0
            continue
        j, how = DAMAGE[i]
        observed[how] = {
            "chunk": j,
            "tokens_restored": k["tokens_remote"],
            "chunks_recomputed_after_failure": fallbacks,
        }
        # the valid chunks before the bad one are used, nothing from it on
        assert k["tokens_remote"] == j * CHUNK, (how, k)
        assert fallbacks == N_CHUNKS - j, (how, fallbacks)

    # every bad entry is gone; the good ones around it stay
    with open_index(redis_url) as index:
        for i in bad:
            j, how = DAMAGE[i]
            got = index.lookup(ns, [f for f, _ in chains[i]])
            assert got[j] is None, f"{how}: the bad entry was not dropped"
            assert all(e is not None for e in got[:j]), f"{how}: a good entry was dropped"
            observed[how]["entry_dropped"] = True

        # the client's counters reach the index with B's next lookup
        b.complete(body(prompts[CONTROL]))

        def counted() -> bool:
            c = index.counters()
            return c.get("missing_objects", 0) >= 1 and c.get("verify_failures", 0) >= 4

        assert wait_for(counted, 10), index.counters()
        counters = index.counters()
    assert counters.get("entries_dropped", 0) >= len(DAMAGE)
    # a second pass is served from B's memory; a fresh worker must not trip over them again
    c = spawn("c", store, redis_url, write_policy="off")
    for i, p in enumerate(prompts[:CONTROL]):
        out = c.complete(body(p))
        assert answer(out) == reference.tokens(p)
        assert out["kvcloud"]["tokens_remote"] == DAMAGE[i][0] * CHUNK
    assert c.metrics()["kvcloud_worker_remote_fallbacks_total"] == 0

    reliability.note(
        cases=observed,
        remote_fallbacks_total=fallback_total,
        client_counters={
            k: counters.get(k, 0) for k in ("missing_objects", "verify_failures", "entries_dropped")
        },
        fresh_worker_fallbacks=0,
        wrong_answers=0,
    )
