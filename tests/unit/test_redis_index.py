"""RedisIndex behaviour the shared contract cannot see: round trips, failures, secrets."""

from __future__ import annotations

import gc
import hashlib
import struct
import threading
import time
import weakref
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.connection

from kvcloud.errors import ConfigError, IndexUnavailableError
from kvcloud.indexes import IndexEntry, RedisIndex, open_index, redis_layout
from kvcloud.indexes.deferred import Deferred
from kvcloud.indexes.redis_layout import entry_field
from tests.servers import RedisServer, free_port, start_redis

pytestmark = pytest.mark.integration

NS = "ns0123456789abcdef"


def fp(i: int) -> str:
    return f"{i:064x}"


def entry(i: int) -> IndexEntry:
    return IndexEntry(f"segments/{i}", 256, 4096, 1_700_000_000.0)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private server this test may kill, pause or reconfigure."""
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def _commandstats(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name: int(v["calls"]) for name, v in stats.items()}


# -- one round trip ---------------------------------------------------------------------------


class RoundTrips:
    """Records, for the calling thread only, every socket write and read of redis-py, every
    single command and every pipeline. A round trip is one write followed by reads; a second
    write after a read would be a second round trip."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.thread = threading.get_ident()
        self.events: list[str] = []
        self.commands: list[Any] = []
        self.pipelines: list[int] = []
        self.other_threads = 0
        conn_cls = redis.connection.Connection
        send, read = conn_cls.send_packed_command, conn_cls.read_response
        real_execute = redis.client.Pipeline.execute
        real_execute_command = redis.Redis.execute_command

        def record(what: list[Any], item: Any) -> None:
            if threading.get_ident() == self.thread:
                what.append(item)
            else:
                self.other_threads += 1

        def counting_send(conn: Any, command: Any, check_health: bool = True) -> None:
            record(self.events, "send")
            send(conn, command, check_health)

        def counting_read(conn: Any, *args: Any, **kwargs: Any) -> Any:
            record(self.events, "read")
            return read(conn, *args, **kwargs)

        def counting_execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            record(self.pipelines, len(pipe.command_stack))
            return real_execute(pipe, *args, **kwargs)

        def counting_execute_command(client: Any, *args: Any, **kwargs: Any) -> Any:
            record(self.commands, args[0])
            return real_execute_command(client, *args, **kwargs)

        monkeypatch.setattr(conn_cls, "send_packed_command", counting_send)
        monkeypatch.setattr(conn_cls, "read_response", counting_read)
        monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
        monkeypatch.setattr(redis.Redis, "execute_command", counting_execute_command)


def _delta(before: dict[str, int], after: dict[str, int], command: str) -> int:
    return after.get(f"cmdstat_{command}", 0) - before.get(f"cmdstat_{command}", 0)


def _bucket(idx: RedisIndex, ns: str, fp_hex: str) -> str:
    return idx._buckets(ns, [entry_field(fp_hex)])[0]


def _expires_at(client: redis.Redis, idx: RedisIndex, ns: str, fp_hex: str) -> float | None:
    """The expiry stored in an entry's value (None when the field is absent)."""
    raw = client.hget(_bucket(idx, ns, fp_hex), entry_field(fp_hex))
    return None if raw is None else struct.unpack_from("<d", raw, 1)[0]


def hfp(i: int) -> str:
    """A fingerprint as real ones are: a hash, so its leading bits (the bucket) are uniform."""
    return hashlib.sha256(i.to_bytes(8, "big")).hexdigest()


@pytest.mark.parametrize("n", [1, 128, 1000])
def test_lookup_request_path_is_one_round_trip(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    # A long renew_delay: the background batch cannot go out while we count.
    idx = RedisIndex(redis_url, ttl_seconds=100, renew_delay=30)
    present = list(range(0, n, 2))
    # registered with a short TTL, so the lookup's hits are due for renewal
    with RedisIndex(redis_url, ttl_seconds=5) as short:
        assert short.register_many(NS, [(hfp(i), entry(i)) for i in present]) == [True] * len(
            present
        )
    client = redis.Redis.from_url(redis_url)
    idx.ping()  # the connection exists (and its handshake is done) before we count
    before = _commandstats(redis_url)

    trips = RoundTrips(monkeypatch)
    got = idx.lookup(NS, [hfp(i) for i in range(n)], counters={"hits": 64, "misses": 64})
    monkeypatch.undo()

    assert got == [entry(i) if i % 2 == 0 else None for i in range(n)]
    # the calling thread: one command (the lookup script), written once, one reply read
    assert trips.commands == ["EVALSHA"]
    assert trips.pipelines == []
    assert trips.events == ["send", "read"]
    assert trips.other_threads == 0  # nothing in the background yet either
    middle = _commandstats(redis_url)
    assert _delta(before, middle, "evalsha") == 1
    assert _delta(before, middle, "hget") == n  # inside the script
    assert _delta(before, middle, "hset") == _delta(before, middle, "hincrby") == 0

    # the side effects follow in the background: renewal of every hit (only), the counters
    start = time.time()
    assert idx.flush(5.0)
    after = _commandstats(redis_url)
    assert _delta(middle, after, "hset") == len(present)
    # the two counters, and the renewed hits moved in the exporter's bookkeeping from their
    # old expiry slot to the new one: entries, bytes, tokens out of one slot (two, where the
    # registrations straddled a slot's end) into another, summed per slot (redis_stats.py)
    assert 2 + 6 <= _delta(middle, after, "hincrby") <= 2 + 9
    for i in present:
        assert (_expires_at(client, idx, NS, hfp(i)) or 0) >= start + 99
    assert all(_expires_at(client, idx, NS, hfp(i)) is None for i in range(1, n, 2))
    assert idx.counters() == {"hits": 64, "misses": 64}
    client.close()
    idx.close()


def test_lookup_run_stops_at_the_first_miss(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    idx = RedisIndex(redis_url, renew_delay=30)
    chain = [hfp(i) for i in range(128)]
    gone = 40
    registered = [(fp_hex, entry(i)) for i, fp_hex in enumerate(chain) if i != gone]
    assert all(idx.register_many(NS, registered))
    idx.ping()
    before = _commandstats(redis_url)
    trips = RoundTrips(monkeypatch)
    run = idx.lookup_run(NS, chain)
    monkeypatch.undo()
    assert run == [entry(i) for i in range(gone)]  # what follows the miss is never read
    assert trips.commands == ["EVALSHA"] and trips.events == ["send", "read"]
    assert _delta(before, _commandstats(redis_url), "hget") == gone + 1
    # the generic lookup still answers every position
    assert idx.lookup(NS, chain)[gone - 1 : gone + 2] == [entry(gone - 1), None, entry(gone + 1)]
    assert idx.lookup_run(NS, []) == []
    idx.close()


@pytest.mark.parametrize("buckets", [4096, 1 << 20])
def test_bucket_names_follow_the_layout_in_many_namespaces(redis_url: str, buckets: int) -> None:
    # 4,096 buckets: names come from a per-namespace table (bounded in count); 2**20: formatted
    # per lookup. Either way a bucket is named by the fingerprint's leading 32 bits.
    idx = RedisIndex(f"{redis_url}?buckets={buckets}", renew_delay=30)
    spaces = [f"ns-{k}" for k in range(redis_layout._NAME_TABLES + 2)]
    chain = [hfp(i) for i in range(16)]
    for ns in spaces:
        assert all(idx.register_many(ns, [(h, entry(i)) for i, h in enumerate(chain)]))
    for ns in spaces + spaces[:1]:  # the first namespace again, after its table was dropped
        assert idx.lookup_run(ns, chain) == [entry(i) for i in range(16)]
    assert len(idx._name_tables) <= redis_layout._NAME_TABLES
    client = redis.Redis.from_url(redis_url)
    keys = {k.decode() for k in client.scan_iter(match="kvc:h:*")}
    client.close()
    expected = {f"kvc:h:{ns}:{int(h[:8], 16) & (buckets - 1):x}" for ns in spaces for h in chain}
    assert keys == expected
    idx.close()


def test_fresh_hits_are_not_renewed(redis_url: str) -> None:
    # Renewing every lookup of a hot prefix would cost a write per lookup: a hit whose expiry
    # is within a hundredth of the TTL (at most a minute) of a fresh one is left alone.
    idx = RedisIndex(redis_url, ttl_seconds=1000, renew_delay=0)
    idx.register(NS, hfp(1), entry(1))
    before = _commandstats(redis_url)
    for _ in range(5):
        assert idx.lookup_run(NS, [hfp(1)]) == [entry(1)]
    assert idx.flush(5.0)
    assert _delta(before, _commandstats(redis_url), "hset") == 0
    idx.close()


def test_register_many_is_one_round_trip(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    idx = RedisIndex(redis_url)
    assert idx.register(NS, hfp(0), entry(0))
    idx.ping()
    before = _commandstats(redis_url)
    trips = RoundTrips(monkeypatch)
    got = idx.register_many(NS, [(hfp(i), entry(i)) for i in range(1000)])
    monkeypatch.undo()
    assert got == [False] + [True] * 999
    # one pipeline of two scripts (512 entries each at most), written once, two replies read
    assert trips.pipelines == [2]
    assert trips.commands == []
    assert trips.events == ["send", "read", "read"]
    after = _commandstats(redis_url)
    assert _delta(before, after, "evalsha") == 2
    assert _delta(before, after, "hset") == 999
    assert _delta(before, after, "multi") == 0  # not a transaction: cluster-friendly
    idx.close()


def test_scripts_lost_by_the_server_are_loaded_again(redis_url: str) -> None:
    idx = RedisIndex(redis_url, ttl_seconds=100, renew_delay=0)
    with RedisIndex(redis_url, ttl_seconds=5) as short:
        short.register(NS, hfp(1), entry(1))
    client = redis.Redis.from_url(redis_url)
    client.script_flush()  # what a restart does
    assert idx.register(NS, hfp(2), entry(2)) is True
    client.script_flush()
    start = time.time()
    assert idx.lookup(NS, [hfp(1), hfp(2)], counters={"hits": 2}) == [entry(1), entry(2)]
    client.script_flush()
    assert idx.flush(5.0)
    assert (_expires_at(client, idx, NS, hfp(1)) or 0) >= start + 99  # renewed after a reload
    assert idx.counters() == {"hits": 2}  # counted once, not once per attempt
    client.close()
    idx.close()


def test_background_renewal_slides_the_ttl_of_hits_only(redis_url: str) -> None:
    idx = RedisIndex(redis_url, ttl_seconds=100)  # the default renew_delay
    client = redis.Redis.from_url(redis_url)
    with RedisIndex(redis_url, ttl_seconds=5) as short:
        short.register(NS, hfp(1), entry(1))
    idx.ping()  # the connection exists before we count
    before = _commandstats(redis_url)
    start = time.time()
    assert idx.lookup(NS, [hfp(1), hfp(2)]) == [entry(1), None]
    # No flush: the thread sends on its own (renew_delay later). What is asserted is that it
    # happened, not how soon: a wall-clock bound flakes on a loaded machine, and the
    # deadline only stops a renewal that never comes from hanging the test.
    deadline = time.monotonic() + 30.0
    while (_expires_at(client, idx, NS, hfp(1)) or 0) < start + 99:
        assert time.monotonic() < deadline, "not renewed without a flush"
        time.sleep(0.005)
    assert (_expires_at(client, idx, NS, hfp(1)) or 0) <= time.time() + 100
    # one renewal of the one hit (a field written once), by the background thread alone
    after = _commandstats(redis_url)
    assert _delta(before, after, "hset") == 1
    assert idx.flush(5.0)  # nothing left queued: the renewal above was the whole batch
    assert _delta(before, _commandstats(redis_url), "hset") == 1
    assert client.pttl(_bucket(idx, NS, hfp(1))) > 99_000  # the bucket outlives its entries
    assert _expires_at(client, idx, NS, hfp(2)) is None  # a miss creates nothing
    client.close()
    idx.close()


def test_late_renewal_does_not_resurrect_a_deleted_entry(redis_url: str) -> None:
    idx = RedisIndex(redis_url, ttl_seconds=100, renew_delay=30)
    with RedisIndex(redis_url, ttl_seconds=5) as short:
        short.register(NS, hfp(1), entry(1))
        short.register(NS, hfp(2), entry(2))
    assert idx.lookup(NS, [hfp(1), hfp(2)]) == [entry(1), entry(2)]
    # Deleted while the renewals are still queued: by drop (gc's path) and behind our back.
    assert idx.drop(NS, hfp(1), object_key=entry(1).object_key)
    client = redis.Redis.from_url(redis_url)
    assert client.hdel(_bucket(idx, NS, hfp(2)), entry_field(hfp(2))) == 1
    assert idx.flush(5.0)
    assert _expires_at(client, idx, NS, hfp(1)) is None
    assert _expires_at(client, idx, NS, hfp(2)) is None
    assert idx.lookup(NS, [hfp(1), hfp(2)]) == [None, None]
    client.close()
    idx.close()


def test_expired_fields_are_swept_from_a_busy_bucket(redis_url: str) -> None:
    # Redis 7.0 cannot expire a hash field; a bucket that keeps receiving entries would keep
    # its dead ones forever unless registrations sweep them.
    client = redis.Redis.from_url(redis_url)
    with RedisIndex(redis_url + "?buckets=1") as idx:
        assert idx.register(NS, hfp(1000), entry(1000))  # keeps the bucket alive
    with RedisIndex(redis_url + "?buckets=1", ttl_seconds=1) as short:
        short.register_many(NS, [(hfp(i), entry(i)) for i in range(20)])
    time.sleep(1.1)
    with RedisIndex(redis_url + "?buckets=1") as idx:
        (bucket,) = idx._buckets(NS, [entry_field(hfp(0))])
        assert client.hlen(bucket) == 21
        assert idx.lookup(NS, [hfp(0)]) == [None]  # expired: invisible at once
        assert idx.count_entries(NS) == 1
        idx.register_many(NS, [(hfp(100 + i), entry(i)) for i in range(11)])  # 32nd field
        assert client.hlen(bucket) == 12
        assert idx.count_entries(NS) == 12
    client.close()


def test_standard_entries_stay_in_compact_listpacks(redis_url: str) -> None:
    # The memory figure in OPERATIONS.md depends on it: a field of at most 64 bytes and a
    # value of at most 64 keep the hash a listpack.
    from kvcloud.segment import object_key

    client = redis.Redis.from_url(redis_url)
    ns = "n" * 32
    digests = [hfp(10_000 + i) for i in range(100)]
    entries = [
        (hfp(i), IndexEntry(object_key(ns, d + (".b3" if i % 2 else "")), 256, 2**35, time.time()))
        for i, d in enumerate(digests)
    ]
    with RedisIndex(redis_url + "?buckets=1") as idx:
        assert all(idx.register_many(ns, entries))
        (bucket,) = idx._buckets(ns, [entry_field(hfp(0))])
        assert client.object("encoding", bucket) == b"listpack"
        assert max(len(v) for v in client.hvals(bucket)) <= 62
        assert idx.lookup(ns, [fp_hex for fp_hex, _ in entries]) == [e for _, e in entries]
        # a key that is not in the standard form round-trips too (stored as text)
        odd = IndexEntry(f"{ns}/zz/not-a-digest", 1, 2, 3.5)
        assert idx.register(ns, hfp(999), odd)
        assert idx.lookup(ns, [hfp(999)]) == [odd]
    client.close()


def test_entries_of_the_previous_layout_stay_visible_to_maintenance(redis_url: str) -> None:
    # Releases before 0.13 wrote a string key per entry; after an upgrade gc, verify and
    # stats must still see them (else gc would take their objects for orphans) until they
    # expire, and drop must remove them.
    import msgpack

    client = redis.Redis.from_url(redis_url)
    old = IndexEntry("segments/old", 16, 10, 1.0)
    key = f"kvc:e:{NS}:{hfp(1)}"
    client.set(key, msgpack.packb(["segments/old", 16, 10, 1.0]), px=50_000)
    with RedisIndex(redis_url) as idx:
        idx.register(NS, hfp(2), entry(2))
        records = {r.fp: r for r in idx.iter_entries(NS)}
        assert records[hfp(1)].entry == old and records[hfp(2)].entry == entry(2)
        assert idx.count_entries() == 2
        assert idx.drop(NS, hfp(1), object_key="segments/other") is False
        assert idx.drop(NS, hfp(1), object_key="segments/old") is True
        assert client.exists(key) == 0
    client.close()


def test_close_sends_pending_counters(redis_url: str) -> None:
    idx = RedisIndex(redis_url, renew_delay=60)
    idx.register(NS, fp(1), entry(1))
    idx.lookup(NS, [fp(1)], counters={"lookups": 1, "chunks_hit": 1})
    idx.lookup(NS, [], counters={"lookups": 1})  # counters alone: no round trip at all
    start = time.monotonic()
    idx.close()
    assert time.monotonic() - start < 5.0  # close cuts the delay short
    with RedisIndex(redis_url) as other:
        assert other.counters() == {"lookups": 2, "chunks_hit": 1}


def test_counters_reads_its_own_pending_increments(redis_url: str) -> None:
    with RedisIndex(redis_url, renew_delay=60) as idx:
        idx.lookup(NS, [fp(1)], counters={"misses": 1})
        assert idx.counters() == {"misses": 1}


def test_side_effects_survive_an_outage_and_never_raise(own_redis: RedisServer) -> None:
    idx = RedisIndex(own_redis.url, renew_delay=60)
    idx.register(NS, fp(1), entry(1))
    assert idx.lookup(NS, [fp(1)], counters={"lookups": 1}) == [entry(1)]
    own_redis.kill()
    # The background send fails: nothing reaches the caller, the counters are kept.
    assert idx.flush(10.0)
    own_redis.start()  # empty again (no persistence)
    assert idx.counters() == {"lookups": 1}
    idx.close()


def test_side_effects_lost_to_a_dead_server_do_not_hang_close(own_redis: RedisServer) -> None:
    idx = RedisIndex(own_redis.url, renew_delay=60)
    idx.register(NS, fp(1), entry(1))
    assert idx.lookup(NS, [fp(1)], counters={"lookups": 1}) == [entry(1)]
    own_redis.kill()
    start = time.monotonic()
    idx.close()  # logs that the counters are lost; does not raise
    assert time.monotonic() - start < 10.0


def test_unclosed_index_is_collected_and_its_thread_exits(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    idx.lookup(NS, [fp(1)], counters={"lookups": 1})
    thread = idx._deferred._thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(idx)
    del idx
    gc.collect()
    assert ref() is None  # the background thread does not keep the index alive
    thread.join(5.0)
    assert not thread.is_alive()


def test_deferred_drops_when_full_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    sent: list[tuple[list[Hashable], dict[str, int]]] = []

    class Sink:
        def send(self, keys: list[Hashable], counters: dict[str, int]) -> None:
            sent.append((keys, counters))

    sink = Sink()
    deferred = Deferred(sink.send, "test-deferred", delay=60, max_keys=4)
    deferred.submit(["a", "b", "a"], {"n": 1})
    deferred.submit(["c", "d"], {"n": 2})  # would exceed max_keys: dropped, counters kept
    deferred.submit([], None)  # nothing at all
    assert any("dropped" in r.getMessage() for r in caplog.records)
    assert deferred.flush(5.0)
    assert sent == [(["a", "b"], {"n": 3})]  # one batch, keys once each
    deferred.submit(["e"], None)  # room again after the batch went out
    deferred.close(5.0)
    assert sent[-1] == (["e"], {})

    class Broken:
        def send(self, keys: list[Hashable], counters: dict[str, int]) -> None:
            raise RuntimeError("boom")

    broken = Broken()
    deferred = Deferred(broken.send, "test-broken", delay=0)
    deferred.submit(["x"], {"n": 1})  # the failure is logged by the thread, never raised
    assert deferred.flush(5.0)
    deferred.close(5.0)


def test_cluster_fallback_is_single_key_commands(redis_url: str) -> None:
    class Pipelined(RedisIndex):
        _single_key = True

    idx = Pipelined(redis_url, ttl_seconds=100)
    with RedisIndex(redis_url, ttl_seconds=5) as short:
        short.register(NS, hfp(1), entry(1))
    before = _commandstats(redis_url)
    assert idx.lookup(NS, [hfp(1), hfp(2)], counters={"hits": 1}) == [entry(1), None]
    assert idx.flush(5.0)
    after = _commandstats(redis_url)
    assert _delta(before, after, "hget") == 3  # two lookups, one inside the renewal
    assert _delta(before, after, "eval") == 1  # the renewal, one key
    assert _delta(before, after, "evalsha") == 0
    assert idx.counters() == {"hits": 1}
    idx.close()


def test_key_schema_has_no_hash_tags(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    idx.register(NS, fp(1), entry(1))
    idx.put_session("tenant:a", "s:1", b"r")
    idx.incr({"hits": 1})
    client = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in client.keys("*"))
    client.close()
    assert keys == ["kvc:counters", _bucket(idx, NS, fp(1)), "kvc:s:tenant%3Aa:s%3A1"]
    assert _bucket(idx, NS, fp(1)).startswith(f"kvc:h:{NS}:")
    assert not any("{" in k for k in keys)
    idx.close()


def test_undecodable_entry_is_a_miss(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.hset(_bucket(idx, NS, fp(1)), entry_field(fp(1)), b"\xc1 not an entry")
    client.close()
    assert idx.lookup(NS, [fp(1)]) == [None]
    assert idx.lookup_run(NS, [fp(1)]) == []
    assert idx.drop(NS, fp(1), object_key="segments/1") is False
    assert idx.register(NS, fp(1), entry(1)) is True  # garbage counts as absent
    assert idx.lookup(NS, [fp(1)]) == [entry(1)]
    idx.close()


def test_bad_bucket_counts_are_config_errors() -> None:
    for value in ("0", "3", "-4", "x", str(1 << 25)):
        with pytest.raises(ConfigError, match="buckets"):
            RedisIndex(f"redis://127.0.0.1:1/0?buckets={value}")
    assert RedisIndex("redis://127.0.0.1:1/0?buckets=65536").buckets == 65536


# -- failures -----------------------------------------------------------------------------------


def test_closed_port_fails_fast() -> None:
    idx = RedisIndex(f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    for call in (
        idx.ping,
        lambda: idx.lookup(NS, [fp(1)]),
        lambda: idx.register(NS, fp(1), entry(1)),
        lambda: list(idx.iter_entries()),
    ):
        start = time.monotonic()
        with pytest.raises(IndexUnavailableError) as info:
            call()
        assert time.monotonic() - start < 5.0
        message = str(info.value)
        assert idx.url in message
        assert "hunter2" not in message
        assert "redis-server is running" in message


def test_killed_server_then_restart_reconnects(own_redis: RedisServer) -> None:
    idx = RedisIndex(own_redis.url)
    assert idx.register(NS, fp(1), entry(1))
    assert idx.lookup(NS, [fp(1)]) == [entry(1)]

    own_redis.kill()
    for call in (lambda: idx.lookup(NS, [fp(1)]), idx.ping, idx.counters):
        start = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            call()
        assert time.monotonic() - start < 5.0

    own_redis.start()  # same port; no persistence, so the data is gone
    assert idx.lookup(NS, [fp(1)]) == [None]
    assert idx.register(NS, fp(1), entry(1)) is True
    assert idx.lookup(NS, [fp(1)]) == [entry(1)]
    idx.close()


def test_paused_server_times_out_then_recovers(own_redis: RedisServer) -> None:
    idx = RedisIndex(own_redis.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    idx.register(NS, fp(1), entry(1))
    own_redis.pause()
    try:
        start = time.monotonic()
        with pytest.raises(IndexUnavailableError, match="TimeoutError"):
            idx.lookup(NS, [fp(1)])
        # a timeout is not retried: one socket_timeout, not several
        assert time.monotonic() - start < 2.0
    finally:
        own_redis.resume()
    assert idx.lookup(NS, [fp(1)]) == [entry(1)]
    idx.close()


# -- secrets ------------------------------------------------------------------------------------

PASSWORD = "s3cr:t@/pw%"  # characters that need percent-encoding in a URL


@pytest.fixture
def password_redis(own_redis: RedisServer) -> Iterator[RedisServer]:
    client = redis.Redis.from_url(own_redis.url)
    client.config_set("requirepass", PASSWORD)
    client.close()
    yield own_redis


def _url_with_password(server: RedisServer, password: str) -> str:
    return f"redis://:{quote(password, safe='')}@127.0.0.1:{server.port}/0"


def _assert_no_secret(text: str) -> None:
    for secret in (PASSWORD, quote(PASSWORD, safe=""), "wrong-pass", "s3cr"):
        assert secret not in text


def test_wrong_password_is_reported_without_the_password(password_redis: RedisServer) -> None:
    idx = RedisIndex(_url_with_password(password_redis, "wrong-pass"))
    _assert_no_secret(idx.url)
    _assert_no_secret(repr(idx))
    start = time.monotonic()
    with pytest.raises(IndexUnavailableError, match="password") as info:
        idx.ping()
    assert time.monotonic() - start < 1.0  # authentication failures are not retried
    _assert_no_secret(str(info.value))
    assert "***" in str(info.value)  # it does name the (redacted) URL

    no_password = RedisIndex(password_redis.url)
    with pytest.raises(IndexUnavailableError) as info:
        no_password.lookup(NS, [fp(1)])
    _assert_no_secret(str(info.value))


def test_right_password_works_and_stays_hidden(password_redis: RedisServer) -> None:
    url = _url_with_password(password_redis, PASSWORD)
    with open_index(url) as idx:
        _assert_no_secret(idx.url)
        _assert_no_secret(repr(idx))
        assert idx.register(NS, fp(1), entry(1))
        assert idx.lookup(NS, [fp(1)]) == [entry(1)]
        password_redis.kill()
        with pytest.raises(IndexUnavailableError) as info:
            idx.ping()
        _assert_no_secret(str(info.value))
        _assert_no_secret(repr(info.value))


def test_bad_url_options_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        RedisIndex("redis://localhost:6379/0?ttl=soon")
    with pytest.raises(ConfigError):
        RedisIndex("sqlite:///tmp/x.db")
    with pytest.raises(ConfigError) as info:
        RedisIndex("http://:topsecret@localhost/")
    assert "topsecret" not in str(info.value)


def test_rediss_uses_tls_and_passes_options_through() -> None:
    idx = RedisIndex("rediss://:pw@cache.example:6380/2?prefix=p&ssl_cert_reqs=none&ttl=9")
    kwargs = idx._client.connection_pool.connection_kwargs
    assert idx._client.connection_pool.connection_class is redis.connection.SSLConnection
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.example", 6380, 2)
    assert kwargs["ssl_cert_reqs"] == "none"
    assert (idx.prefix, idx.ttl_seconds) == ("p", 9)
    assert "pw" not in idx.url
    idx.close()
