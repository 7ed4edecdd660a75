"""Eight workers pushing identical and overlapping prefixes at the same moment.

Content addressing and SET NX registration must make concurrent pushes of the same chunk
harmless: exactly one object per content, exactly one entry per fingerprint, no upload
failing because another worker won the race, and every worker answering like the reference.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
import redis as redis_py

from kvcloud.segment import read_header
from kvcloud.stores import open_store
from tests.faults.conftest import CHUNK, Reference, Worker, answer, body, s3_url, text
from tests.faults.report import Observation
from tests.s3_servers import WITHOUT_CONDITIONAL_WRITES, S3Server, server_name

pytestmark = pytest.mark.integration

WORKERS = 8
BOS = 256


def _prompts() -> list[str]:
    """Identical and overlapping prefixes. Every prompt is 3 tokens past a chunk boundary
    (with BOS), so the 8 generated tokens never complete a chunk: the chunks are exactly
    the prompts'."""
    base = text(200, 800)
    return [
        base[:66],  # 4 chunks, sent by every worker
        base[:98],  # the same 4 chunks and 2 more
        base[:47] + text(35, 801),  # shares 3 chunks with the above, then its own 2
        base[:47] + text(35, 802),  # shares the same 3, then 2 others
        base[:31] + text(51, 803),  # shares 2
        text(66, 804),  # nothing shared (but sent by all 8)
    ]


def _distinct_chunks(prompts: list[str]) -> int:
    prefixes = set()
    for p in prompts:
        tokens = (BOS, *p.encode())
        for i in range(1, len(tokens) // CHUNK + 1):
            prefixes.add(tokens[: i * CHUNK])
    return len(prefixes)


# Ceph honours If-None-Match; Swift refuses it and rclone ignores it, so there the workers'
# stores ask with a HEAD first and racing PUTs can both write (the same bytes)
@pytest.mark.parametrize("s3_server", ["ceph", *WITHOUT_CONDITIONAL_WRITES], indirect=True)
def test_eight_workers_push_the_same_prefixes_at_once(
    s3_server: S3Server,
    redis_url: str,
    spawn: Callable[..., Worker],
    reference: Reference,
    reliability: Observation,
) -> None:
    reliability.scenario = (
        f"{WORKERS} workers pushing identical and overlapping prefixes at once, "
        f"on {server_name(s3_server)}"
    )
    reliability.must = (
        "one object per content and one entry per fingerprint (counted with SCAN and "
        "ListObjects), no failed upload, every worker's answers identical to the reference"
    )
    prefix = f"faults-race-{time.monotonic_ns()}"
    store = s3_url(s3_server.endpoint, prefix)
    prompts = _prompts()
    expected = _distinct_chunks(prompts)
    for p in prompts:
        reference.tokens(p)
    with ThreadPoolExecutor(WORKERS) as pool:
        workers = list(
            pool.map(
                lambda i: spawn(f"w{i}", store, redis_url, write_policy="write-through"),
                range(WORKERS),
            )
        )
    ns = workers[0].health()["namespace"]

    gate = threading.Barrier(WORKERS)

    def run(i: int) -> list[tuple[str, list[int]]]:
        order = list(prompts)
        random.Random(i).shuffle(order)
        gate.wait(timeout=60)  # everyone starts pushing at the same moment
        return [(p, answer(workers[i].complete(body(p)))) for p in order]

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(run, range(WORKERS)))
    with ThreadPoolExecutor(WORKERS) as pool:
        drained = list(pool.map(lambda w: w.drain(timeout=60), workers))
    assert all(drained), "uploads did not finish"
    wrong = sum(1 for res in results for p, got in res if got != reference.tokens(p))
    assert wrong == 0

    # entries: the namespace's buckets, read directly (HGETALL, not through the index)
    r = redis_py.Redis.from_url(redis_url)
    try:
        entry_keys = {
            (k, f) for k in r.scan_iter(match=f"kvc:h:{ns}:*", count=1000) for f in r.hkeys(k)
        }
    finally:
        r.close()
    # objects: ListObjectsV2 on the bucket, paginated
    # a new session reads the server's credentials from the environment (boto3's default
    # session keeps the first ones it found)
    s3 = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1"
    )
    objects: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kvcloud", Prefix=prefix):
        objects += [o["Key"] for o in page.get("Contents", [])]
    # what each object holds: one object per fingerprint means one per content
    with open_store(store) as st:
        fps = Counter(read_header(st.get(k.removeprefix(prefix + "/")))[0].fp for k in objects)
    uploads = Counter[str]()
    for w in workers:
        m = w.metrics()
        for result in ("ok", "failed", "dropped"):
            uploads[result] += int(m.get(f'kvcloud_worker_uploads_total{{result="{result}"}}', 0))

    reliability.note(
        workers=WORKERS,
        requests=sum(len(r) for r in results),
        distinct_chunks=expected,
        index_entries=len(entry_keys),
        objects=len(objects),
        max_objects_per_fingerprint=max(fps.values()),
        uploads=dict(uploads),
        wrong_answers=wrong,
    )
    assert len(entry_keys) == expected
    assert len(objects) == expected
    assert len(fps) == expected and max(fps.values()) == 1
    assert uploads["failed"] == 0 and uploads["dropped"] == 0
