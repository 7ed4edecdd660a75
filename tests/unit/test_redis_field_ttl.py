"""RedisIndex's per-entry TTL in hash fields (``field_ttl``), on Redis 8 and Valkey 9, and what
it does beside the value-expiry layout Redis 7.0 keeps."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
import redis

from kvcloud.errors import ConfigError, IndexBackendError
from kvcloud.indexes import IndexEntry, RedisIndex
from kvcloud.indexes.redis_layout import entry_field
from tests.servers import RedisServer, start_redis

pytestmark = pytest.mark.integration

NS = "ns0123456789abcdef"


def hfp(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "big")).hexdigest()


def entry(i: int) -> IndexEntry:
    return IndexEntry(f"segments/{i}", 256, 4096, 1_700_000_000.0)


@pytest.fixture(scope="module", params=["redis8", "valkey9"])
def flavor(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(flavor: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = start_redis(tmp_path_factory.mktemp(flavor), flavor=flavor)
    yield s
    s.stop()


@pytest.fixture
def url(server: RedisServer) -> Iterator[str]:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    client.close()
    yield server.url


def forced(url: str, *options: str) -> str:
    """The index URL with field TTL on (``auto`` leaves it off on Valkey)."""
    return url + "?" + "&".join(["field_ttl=on", *options])


@pytest.fixture
def client(url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(url)
    yield c
    c.close()


def bucket(idx: RedisIndex, fp_hex: str) -> str:
    return idx._buckets(NS, [entry_field(fp_hex)])[0]


def field_ttl_ms(client: redis.Redis, idx: RedisIndex, fp_hex: str) -> int:
    (ms,) = client.execute_command("HPTTL", bucket(idx, fp_hex), "FIELDS", 1, entry_field(fp_hex))
    return int(ms)


def test_entries_carry_their_own_field_ttl(url: str, client: redis.Redis) -> None:
    with RedisIndex(forced(url), ttl_seconds=100) as idx:
        assert idx.register(NS, hfp(1), entry(1))
        assert idx.uses_field_ttl()
        raw = client.hget(bucket(idx, hfp(1)), entry_field(hfp(1)))
        assert raw is not None and raw[0] == 2  # format 2: no expiry inside the value
        assert 99_000 < field_ttl_ms(client, idx, hfp(1)) <= 100_000
        # the bucket keeps a TTL too, at least its entries': volatile-lru can evict it
        assert client.pttl(bucket(idx, hfp(1))) >= field_ttl_ms(client, idx, hfp(1))
        assert idx.lookup(NS, [hfp(1), hfp(2)]) == [entry(1), None]
        (record,) = list(idx.iter_entries(NS))
        assert record.entry == entry(1)
        assert record.expires_at is not None
        assert time.time() + 98 < record.expires_at <= time.time() + 100


def test_the_server_expires_entries_and_empty_buckets(url: str, client: redis.Redis) -> None:
    with RedisIndex(forced(url), ttl_seconds=1) as idx:
        idx.register(NS, hfp(1), entry(1))
        key = bucket(idx, hfp(1))
        deadline = time.monotonic() + 5
        while client.exists(key):  # no reader touches it: the server's own expiry cycle
            assert time.monotonic() < deadline, "the field never expired"
            time.sleep(0.05)
        assert idx.lookup(NS, [hfp(1)]) == [None]
        assert idx.count_entries() == 0


def test_a_hit_renews_its_field_ttl_once_per_interval(url: str, client: redis.Redis) -> None:
    with RedisIndex(forced(url), ttl_seconds=100) as idx:
        idx.register(NS, hfp(1), entry(1))
        key, field = bucket(idx, hfp(1)), entry_field(hfp(1))
        client.execute_command("HPEXPIRE", key, 50_000, "FIELDS", 1, field)
        assert idx.lookup(NS, [hfp(1)]) == [entry(1)]
        assert idx.flush(5.0)
        assert field_ttl_ms(client, idx, hfp(1)) > 99_000  # renewed off the request path
        # renewed a moment ago by this process: the next hits send nothing
        client.execute_command("HPEXPIRE", key, 50_000, "FIELDS", 1, field)
        for _ in range(3):
            assert idx.lookup(NS, [hfp(1)]) == [entry(1)]
        assert idx.flush(5.0)
        assert field_ttl_ms(client, idx, hfp(1)) <= 50_000


def test_a_late_renewal_does_not_resurrect_a_deleted_entry(url: str, client: redis.Redis) -> None:
    with RedisIndex(forced(url), ttl_seconds=100, renew_delay=30) as idx:
        idx.register_many(NS, [(hfp(1), entry(1)), (hfp(2), entry(2))])
        assert idx.lookup(NS, [hfp(1), hfp(2)]) == [entry(1), entry(2)]
        # deleted while the renewals are still queued: by drop (gc's path) and behind our back
        assert idx.drop(NS, hfp(1), object_key=entry(1).object_key)
        assert client.hdel(bucket(idx, hfp(2)), entry_field(hfp(2))) == 1
        assert idx.flush(5.0)
        assert idx.lookup(NS, [hfp(1), hfp(2)]) == [None, None]
        assert field_ttl_ms(client, idx, hfp(1)) == -2  # no such field
        assert field_ttl_ms(client, idx, hfp(2)) == -2


def test_both_layouts_share_a_bucket(url: str, client: redis.Redis) -> None:
    """An index written with value expiry (``field_ttl=off``, as on Redis 7.0) that a
    field-TTL writer joins: every reader sees both; the old entries still expire by their
    value; the bucket's TTL is raised for the new ones."""
    with (
        RedisIndex(url + "?field_ttl=off&buckets=1", ttl_seconds=1) as old,
        RedisIndex(forced(url, "buckets=1"), ttl_seconds=100) as new,
    ):
        assert old.register(NS, hfp(1), entry(1))
        assert not old.uses_field_ttl()
        assert new.register(NS, hfp(2), entry(2))
        key = bucket(new, hfp(2))
        assert client.hget(key, entry_field(hfp(1)))[0] == 1
        assert client.hget(key, entry_field(hfp(2)))[0] == 2
        assert client.pttl(key) > 99_000  # raised for the field-TTL entry
        # (a hit slides its TTL, whichever layout: only the 1 s writer looks them up here)
        assert old.lookup(NS, [hfp(1), hfp(2)]) == [entry(1), entry(2)]
        time.sleep(1.3)
        for idx in (old, new):
            assert idx.lookup(NS, [hfp(1), hfp(2)]) == [None, entry(2)]
        # compare-and-drop reads the object key where each format keeps it
        assert not new.drop(NS, hfp(2), object_key=entry(1).object_key)
        assert new.drop(NS, hfp(2), object_key=entry(2).object_key)
        assert {r.fp for r in old.iter_entries(NS)} == set()


def test_auto_picks_field_ttl_on_redis_only(flavor: str, url: str) -> None:
    """Valkey 9 has HPEXPIRE, but its hashes with field TTLs leave the compact encoding
    (docs/OPERATIONS.md): ``auto`` keeps value expiry there."""
    with RedisIndex(url, ttl_seconds=100) as idx:
        idx.register(NS, hfp(1), entry(1))
        assert idx.uses_field_ttl() == (flavor == "redis8")


def test_field_ttl_off_keeps_value_expiry(url: str, client: redis.Redis) -> None:
    with RedisIndex(url + "?field_ttl=off", ttl_seconds=100) as idx:
        idx.register(NS, hfp(1), entry(1))
        assert client.hget(bucket(idx, hfp(1)), entry_field(hfp(1)))[0] == 1
        assert field_ttl_ms(client, idx, hfp(1)) == -1
        assert client.pttl(bucket(idx, hfp(1))) > 99_000


def test_field_ttl_on_needs_a_server_that_has_it(redis_url: str) -> None:
    """Redis 7.0 (the session's server) has no HPEXPIRE: ``auto`` keeps value expiry, ``on``
    refuses with the reason."""
    with RedisIndex(redis_url, ttl_seconds=100) as idx:
        idx.register(NS, hfp(1), entry(1))
        assert not idx.uses_field_ttl()
    with (
        RedisIndex(redis_url + "?field_ttl=on") as idx,
        pytest.raises(IndexBackendError, match="HPEXPIRE"),
    ):
        idx.register(NS, hfp(2), entry(2))
    with pytest.raises(ConfigError, match="field_ttl"):
        RedisIndex(redis_url + "?field_ttl=sometimes")
