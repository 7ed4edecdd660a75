"""RedisClusterIndex on a real local cluster: URL dispatch, key spreading, a client round
trip, and an unreachable cluster as a miss. (The Index contract suite runs on the cluster in
tests/contracts/test_indexes.py.)"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest

from kvcloud import KVCloud
from kvcloud.errors import ConfigError
from kvcloud.indexes import IndexEntry, open_index
from kvcloud.indexes.cluster import RedisClusterIndex, parse_startup_nodes
from tests.faults.report import Observation
from tests.helpers import make_kv, make_ns, make_tokens, same_bits
from tests.servers import RedisClusterServers, free_port

pytestmark = pytest.mark.integration


def test_open_index_dispatches_cluster_urls(redis_cluster: RedisClusterServers) -> None:
    # a dead startup node first: any reachable one is enough to discover the cluster
    url = f"redis+cluster://127.0.0.1:{free_port()},{redis_cluster.startup}/0?prefix=pf&ttl=30"
    with open_index(url, ttl_seconds=99) as idx:
        assert isinstance(idx, RedisClusterIndex)
        assert (idx.prefix, idx.ttl_seconds) == ("pf", 30)
        assert idx.ping() > 0
        assert idx.register("ns", "ab" * 32, IndexEntry("k", 16, 10, 0.0))
        assert idx.lookup("ns", ["ab" * 32]) == [IndexEntry("k", 16, 10, 0.0)]


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://127.0.0.1:7000/1",
        "redis+cluster://127.0.0.1:notaport",
        "redis+cluster://127.0.0.1:7000?prefix={tag}",
        "redis+cluster://127.0.0.1:7000?ttl=0",
    ],
)
def test_bad_cluster_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_index(url)


def test_parse_startup_nodes() -> None:
    assert parse_startup_nodes("u:p@h1:7000,h2,[::1]:7002") == (
        "u:p",
        [("h1", 7000), ("h2", 6379), ("::1", 7002)],
    )


def test_entry_buckets_spread_over_every_master(redis_cluster: RedisClusterServers) -> None:
    # fingerprints are hashes: their leading bits, which pick the bucket, are uniform
    fps = [hashlib.sha256(i.to_bytes(4, "big")).hexdigest() for i in range(305)]
    n = 300
    with RedisClusterIndex(redis_cluster.url + "?buckets=16") as idx:
        got = idx.register_many("ns", [(fps[i], IndexEntry(f"k{i}", 16, 1, 0.0)) for i in range(n)])
        assert all(got)
        per_node = redis_cluster.keys_per_node("kvc:h:*")
        assert sum(per_node) == 16  # every bucket got entries
        # no hash tag pins a namespace to one master: each holds about a third
        assert min(per_node) >= 3, per_node
        assert idx.count_entries("ns") == n
        found = idx.lookup("ns", fps)
        assert found[:n] == [IndexEntry(f"k{i}", 16, 1, 0.0) for i in range(n)]
        assert found[n:] == [None] * 5
        # the request path stops at the first miss
        assert idx.lookup_run("ns", fps[:10] + fps[n:] + fps[10:20]) == found[:10]


def test_client_round_trip_through_the_cluster(
    redis_cluster: RedisClusterServers, tmp_path: Path, reliability: Observation
) -> None:
    reliability.scenario = "Redis Cluster (3 masters, started by the tests) as the index"
    reliability.must = (
        "a client push → lookup → pull round trip is bit-exact, sessions round-trip, entries "
        "spread over every master (the Index contract suite runs on the same kind of cluster: "
        "tests/contracts/test_indexes.py::TestRedisClusterIndex)"
    )
    ns = make_ns("float16")
    c = ns.chunk_tokens
    n = 40 * c + 5
    toks, arr = make_tokens(n, seed=3), make_kv(ns, n, seed=3)
    store = f"file://{tmp_path / 'objects'}"
    with KVCloud.open(store=store, index=redis_cluster.url, secret="cluster-secret") as kv:
        res = kv.push(ns, toks, arr, tenant="acme")
        assert (res.pushed, res.failed) == (40, 0)
        assert kv.push(ns, toks, arr, tenant="acme").already_indexed == 40
        kv.save_session(ns, "sess-1", toks, arr, tenant="acme")
    with KVCloud.open(store=store, index=redis_cluster.url, secret="cluster-secret") as kv:
        m = kv.lookup(ns, toks, tenant="acme")
        assert m.tokens == 40 * c
        pulled = kv.pull(m)
        assert same_bits(pulled, np.ascontiguousarray(arr[:, :, : 40 * c]))
        assert kv.lookup(ns, toks, tenant="other").tokens == 0  # tenants isolate
        rec = kv.load_session(ns, "sess-1", tenant="acme")
        assert rec.kv_tokens == n
        restored = kv.pull_session(ns, rec, tenant="acme")
        assert same_bits(restored.array, arr)
    per_node = redis_cluster.keys_per_node("kvc:h:*")
    assert all(k > 0 for k in per_node), per_node
    reliability.note(
        masters=len(redis_cluster.nodes),
        chunks_pushed=40,
        tokens_restored_bit_exact=int(pulled.shape[2]),
        session_tokens_restored=restored.tokens,
        entries_per_master=per_node,
    )


def test_unreachable_cluster_is_a_miss_not_an_error(tmp_path: Path) -> None:
    dead = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    ns = make_ns()
    toks = make_tokens(4 * ns.chunk_tokens)
    # opening does not connect (a worker must start while the index is down) ...
    with KVCloud.open(
        store=f"file://{tmp_path / 'o'}", index=dead, connect_timeout=0.5, read_timeout=0.5
    ) as kv:
        t0 = time.monotonic()
        m = kv.lookup(ns, toks)
        # ... and a lookup is an empty match, counted, within the timeouts
        assert m.tokens == 0
        assert time.monotonic() - t0 < 10
        assert kv.stats().get("index_errors") == 1


def test_a_master_killed_and_restarted_is_a_miss_then_recovers(
    tmp_path: Path, reliability: Observation
) -> None:
    reliability.scenario = "a Redis Cluster master killed, then every master, then restarted"
    reliability.must = (
        "lookups fail fast as index-unavailable (a miss for the client, never a hang or a "
        "crash) and work again, without a new client, once the masters are back"
    )
    from kvcloud.errors import IndexBackendError
    from tests.servers import _cluster_state_ok, start_redis_cluster

    servers = start_redis_cluster(tmp_path / "cluster")
    try:
        idx = RedisClusterIndex(servers.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        # hashes, as real fingerprints are: their buckets spread over every master
        fps = [hashlib.sha256(i.to_bytes(4, "big")).hexdigest() for i in range(30)]
        idx.register_many("ns", [(fp, IndexEntry("k", 16, 1, 0.0)) for fp in fps])
        timings: dict[str, float] = {}
        for label, victims in (
            ("one master down", servers.nodes[1:2]),
            ("all down", servers.nodes),
        ):
            for node in victims:
                node.kill()
            t0 = time.monotonic()
            with pytest.raises(IndexBackendError):  # IndexUnavailableError is one too
                idx.lookup("ns", fps)
            timings[label] = round(time.monotonic() - t0, 2)
            assert timings[label] < 5
        for node in servers.nodes:
            node.start()  # nodes.conf brings the same topology back (the data is gone)
        deadline = time.monotonic() + 30
        while not all(_cluster_state_ok(n.host, n.port) for n in servers.nodes):
            assert time.monotonic() < deadline, "the cluster did not come back"
            time.sleep(0.1)
        t0 = time.monotonic()
        while True:
            try:
                found = idx.lookup("ns", fps)
                break
            except IndexBackendError:
                assert time.monotonic() - t0 < 20, "the client did not reconnect"
                time.sleep(0.2)
        assert found == [None] * len(fps)  # no persistence: an index loss is all misses
        assert idx.register("ns", fps[0], IndexEntry("k2", 16, 1, 0.0))
        assert idx.lookup("ns", fps[:1]) == [IndexEntry("k2", 16, 1, 0.0)]
        idx.close()
        reliability.note(failure_latency_s=timings, reconnect_s=round(time.monotonic() - t0, 2))
    finally:
        servers.stop()
