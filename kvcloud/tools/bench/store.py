"""``run_store_bench``: warm-up, measured rounds, lookup and memory figures, cleanup, and the
result ``kvcloud bench store`` prints.
"""

from __future__ import annotations

import os
import platform
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import numpy as np

from ... import __version__
from ...client import KVCloud
from ...config import KVCloudConfig
from ...crypto import ALG
from ...errors import KVCloudError
from ...namespace import Namespace
from ...stores.file import FileStore
from ...urls import redact_url
from .baselines import Plain, plain_client
from .figures import pair_figures, throughput_figures
from .layout import BENCH_ENC_TENANT, BenchError, BenchLayout, random_chunks
from .lookup import index_memory_bench, lookup_bench
from .rounds import Round, delete_objects, run_round
from .servers import local_servers

JSON_VERSION = 1

Progress = Callable[[str], None]


def run_store_bench(
    store: str | None = None,
    index: str | None = None,
    *,
    servers: bool = False,
    layout: BenchLayout | None = None,
    chunks: int = 64,
    concurrency: int | None = None,
    repeat: int = 3,
    pull_passes: int = 3,
    lookup_chunks: int = 128,
    lookup_iters: int = 2000,
    codec: str | None = None,
    keep: bool = False,
    seed: int | None = None,
    progress: Progress | None = None,
    encrypt: bool = False,
) -> dict[str, Any]:
    """Measure push, pull and lookup of kvcloud next to a plain client; return the figures.
    ``encrypt`` adds the same push and pulls for an encrypting tenant, in the same rounds.

    ``store``/``index`` default to KVCLOUD_STORE/KVCLOUD_INDEX; ``servers=True`` starts a
    local moto_server and redis-server for the run instead. ``concurrency`` defaults to
    KVCloudConfig.max_connections; a ``max_connections`` in an s3:// URL wins, and the
    baseline always uses whatever the store really got.
    """
    if min(chunks, repeat, pull_passes, lookup_chunks, lookup_iters) < 1:
        raise BenchError(
            "chunks, repeat, pull-passes, lookup-chunks and lookup-iters must be at least 1"
        )
    if servers and (store or index):
        raise BenchError("--servers starts its own store and index; drop --store/--index")
    layout = layout or BenchLayout.resolve("small")
    say = progress or (lambda _msg: None)
    with ExitStack() as stack:
        if servers:
            say("starting moto_server and redis-server")
            store, index = stack.enter_context(local_servers())
        result = _run(
            store,
            index,
            servers=servers,
            layout=layout,
            chunks=chunks,
            concurrency=concurrency,
            repeat=repeat,
            pull_passes=pull_passes,
            lookup_chunks=lookup_chunks,
            lookup_iters=lookup_iters,
            codec=codec,
            keep=keep,
            seed=seed,
            say=say,
            encrypt=encrypt,
        )
    return result


def _run(
    store: str | None,
    index: str | None,
    *,
    servers: bool,
    layout: BenchLayout,
    chunks: int,
    concurrency: int | None,
    repeat: int,
    pull_passes: int,
    lookup_chunks: int,
    lookup_iters: int,
    codec: str | None,
    keep: bool,
    seed: int | None,
    say: Progress,
    encrypt: bool = False,
) -> dict[str, Any]:
    started = time.time()
    run_id = secrets.token_hex(8)
    ns = layout.namespace(run_id)
    env_cfg = KVCloudConfig.from_env(store=store, index=index, codec=codec)
    requested = concurrency or env_cfg.max_connections
    # The bench never derives fingerprints from the secret (they are random), so a random
    # one keeps the client quiet about the development secret without touching real keys.
    kv = KVCloud.open(
        store=env_cfg.store,
        index=env_cfg.index,
        secret=secrets.token_bytes(32),
        codec=env_cfg.codec,
        max_connections=requested,
        # only the bench's own tenant: whatever KVCLOUD_ENCRYPT_TENANTS says must not turn
        # the unencrypted figures into encrypted ones
        encrypt_tenants=BENCH_ENC_TENANT if encrypt else "",
    )
    plain: Plain | None = None
    pool: ThreadPoolExecutor | None = None
    cleanup: dict[str, Any] = {"kept": keep}
    done: list[Round] = []  # every round run, warm-up included, for the cleanup counts
    try:
        plain = plain_client(kv.store)
        workers = kv.store.max_workers  # what the store really got (an s3 URL may override)
        if workers != requested:
            say(f"the store URL sets {workers} connections; using {workers}, not {requested}")
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcloud-bench")
        say(f"generating {chunks} chunks of {ns.chunk_bytes:,} bytes")
        data = random_chunks(ns, chunks, seed)
        # Destinations of the pulls, allocated and touched once, off the clock: pages like
        # the worker's cache, and one token-major array like pull(out=...) callers use.
        storage = ns.dtype_info.storage
        # np.zeros alone would not touch them (calloc maps zero pages lazily), and the first
        # pull into each would pay the page faults: 200 ms of a 250 ms pull here.
        pages = np.empty((chunks, *ns.kv_shape(ns.chunk_tokens)), dtype=storage)
        out = np.empty(ns.kv_shape(chunks * ns.chunk_tokens), dtype=storage)
        pages.fill(0)
        out.fill(0)

        # Warm-up: opens every pooled connection, starts every thread, creates the bucket
        # prefix and directories; not recorded.
        warm = min(chunks, 2 * workers)
        say(f"warm-up round ({warm} chunks)")
        done.append(
            run_round(
                kv,
                ns,
                plain,
                pool,
                data[:warm],
                pages,
                out,
                "warmup",
                kvcloud_first=True,
                keep=keep,
                encrypt=encrypt,
            )
        )
        rounds: list[Round] = []
        for r in range(repeat):
            say(f"round {r + 1}/{repeat}: push and pull {chunks} chunks, kvcloud and plain")
            # alternate who goes first, so neither side always meets the warmer server
            rounds.append(
                run_round(
                    kv,
                    ns,
                    plain,
                    pool,
                    data,
                    pages,
                    out,
                    f"r{r}",
                    kvcloud_first=r % 2 == 0,
                    keep=keep,
                    encrypt=encrypt,
                    pull_passes=pull_passes,
                )
            )
            done.append(rounds[-1])
        nbytes = rounds[0].nbytes

        def times(attr: str) -> list[float]:
            return [t for x in rounds for t in x.times(attr)]

        push = pair_figures(
            throughput_figures(nbytes, times("push_kvcloud")),
            throughput_figures(nbytes, times("push_plain")),
        )
        pull = pair_figures(
            throughput_figures(nbytes, times("pull_kvcloud")),
            throughput_figures(nbytes, times("pull_plain")),
        )
        pull_array = pair_figures(
            throughput_figures(nbytes, times("pull_array")),
            pull["baseline"],
        )
        push["kvcloud"]["method"] = "KVCloud.push_chunks"
        push["baseline"]["method"] = plain.method_put
        pull["kvcloud"]["method"] = "KVCloud.lookup_fingerprints + pull_into pages (verified)"
        pull["baseline"]["method"] = plain.method_get
        pull_array["kvcloud"]["method"] = "KVCloud.lookup_fingerprints + pull(out=array)"

        encryption: dict[str, Any] | None = None
        if encrypt:
            # Throughput over the same bytes as the unencrypted figures (the plain objects),
            # so each ratio is exactly unencrypted time / encrypted time for the same KV.
            encryption = {
                "alg": ALG,
                "tenant": BENCH_ENC_TENANT,
                "object_bytes": rounds[0].nbytes_encrypted // chunks,
            }
            for op, attr, plain_pair in (
                ("push", "push_encrypted", push),
                ("pull", "pull_encrypted", pull),
                ("pull_array", "pull_array_encrypted", pull_array),
            ):
                figures = throughput_figures(nbytes, times(attr))
                figures["method"] = f"{plain_pair['kvcloud']['method']}, encrypted"
                # the overhead: encrypted vs unencrypted kvcloud, same run, same rounds
                encryption[op] = pair_figures(figures, plain_pair["kvcloud"])
                encryption[f"{op}_vs_baseline"] = pair_figures(figures, plain_pair["baseline"])
                encryption[f"{op}_overhead_pct"] = (1 / encryption[op]["ratio_median"] - 1) * 100

        say(f"index lookup: {lookup_chunks}-chunk prompt × {lookup_iters} vs ping")
        lookup = lookup_bench(kv, ns, lookup_chunks, lookup_iters)
        memory = None
        if servers:
            say("index memory: 100,000 entries")
            # a namespace of its own: _clean need not drop them one by one (the server goes)
            memory = index_memory_bench(kv.index, f"{ns.id}-memory", 100_000)

        result: dict[str, Any] = {
            "bench": "store",
            "version": JSON_VERSION,
            "started": datetime.fromtimestamp(started, UTC).isoformat(),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "machine": platform.machine(),
                "python": platform.python_version(),
                "kvcloud": __version__,
                "numpy": np.__version__,
            },
            "store": redact_url(kv.store.url),
            "index": redact_url(kv.index.url),
            "servers": servers,
            "namespace": ns.id,
            "layout": {
                **asdict(layout),
                "codec": env_cfg.codec,
                "chunk_bytes": ns.chunk_bytes,  # raw KV bytes of one chunk
                "object_bytes": nbytes // chunks,  # encoded segment, header included
            },
            "chunks": chunks,
            "bytes": nbytes,
            "concurrency": workers,
            "repeat": repeat,
            "pull_passes": pull_passes,
            "warmup_chunks": warm,
            "push": push,
            "pull": pull,
            "pull_array": pull_array,
            "lookup": lookup,
        }
        if memory is not None:
            result["index_memory"] = memory
        if encryption is not None:
            result["encryption"] = encryption
    finally:
        run_failed = sys.exc_info()[0] is not None
        try:
            if pool is not None:
                pool.shutdown(wait=True)
            if plain is not None:
                plain.close()
            if not keep:
                say("cleaning up")
                try:
                    swept = _clean(kv, ns)
                except (KVCloudError, OSError) as exc:
                    # Reported, not raised: it must not hide the error that got us here
                    # (often the same outage), and the namespace is unique, so nothing real
                    # is affected by leftovers. When the run already failed the cause is
                    # the error about to be printed; repeating it would bury that one line.
                    if not run_failed:
                        say(f"cleanup of namespace {ns.id} failed: {exc}")
                    else:
                        say(f"cleanup skipped (namespace {ns.id} may hold leftovers)")
                    cleanup["error"] = str(exc)
                    swept = {"objects_deleted": 0, "entries_dropped": 0}
                cleanup["objects_deleted"] = swept["objects_deleted"] + sum(
                    x.objects_deleted for x in done
                )
                cleanup["entries_dropped"] = swept["entries_dropped"] + sum(
                    x.entries_dropped for x in done
                )
        finally:
            kv.close()
    result["cleanup"] = cleanup
    result["elapsed_s"] = time.time() - started
    return result


def _clean(kv: KVCloud, ns: Namespace) -> dict[str, int]:
    """Remove everything the bench wrote: its namespace's objects and entries, and its
    contribution to the index's counters."""
    store, index = kv.store, kv.index
    keys = [info.key for info in store.list(f"{ns.id}/")]
    with ThreadPoolExecutor(max_workers=store.max_workers) as pool:
        delete_objects(store, pool, keys)
    if isinstance(store, FileStore):
        # The namespace directory is the bench's alone (random revision), so unlike a
        # FileStore.delete, removing its empty directories cannot race with anyone.
        shutil.rmtree(store.root / ns.id, ignore_errors=True)
    entries = 0
    for rec in list(index.iter_entries(ns.id)):
        entries += bool(index.drop(ns.id, rec.fp))
    # Every count this client made reaches the index (now or when it closes); subtracting
    # them leaves the deployment's hit/miss statistics as they were before the bench.
    counted = kv.stats()
    if counted:
        index.incr({k: -v for k, v in counted.items()})
    return {"objects_deleted": len(keys), "entries_dropped": entries}
