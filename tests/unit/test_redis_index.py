"""RedisIndex behaviour the shared contract cannot see: round trips, failures, secrets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.connection

from kvcloud.errors import ConfigError, IndexUnavailableError
from kvcloud.indexes import IndexEntry, RedisIndex, open_index
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


def test_lookup_of_128_fps_is_one_round_trip(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    idx = RedisIndex(redis_url)
    for i in range(0, 128, 2):
        assert idx.register(NS, fp(i), entry(i))
    idx.ping()  # the connection exists (and its handshake is done) before we count
    before = _commandstats(redis_url)

    # Record every write to and read from the socket, in order. A round trip is one write
    # followed by reads; a second write after a read would be a second round trip.
    events: list[str] = []
    conn_cls = redis.connection.Connection
    send, read = conn_cls.send_packed_command, conn_cls.read_response
    pipeline_executes: list[int] = []
    single_commands: list[Any] = []
    real_execute = redis.client.Pipeline.execute
    real_execute_command = redis.Redis.execute_command

    def counting_send(self: Any, command: Any, check_health: bool = True) -> None:
        events.append("send")
        send(self, command, check_health)

    def counting_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("read")
        return read(self, *args, **kwargs)

    def counting_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        pipeline_executes.append(len(self.command_stack))
        return real_execute(self, *args, **kwargs)

    def counting_execute_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        single_commands.append(args[0])
        return real_execute_command(self, *args, **kwargs)

    monkeypatch.setattr(conn_cls, "send_packed_command", counting_send)
    monkeypatch.setattr(conn_cls, "read_response", counting_read)
    monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
    monkeypatch.setattr(redis.Redis, "execute_command", counting_execute_command)

    got = idx.lookup(NS, [fp(i) for i in range(128)], counters={"hits": 64, "misses": 64})

    monkeypatch.undo()
    after = _commandstats(redis_url)
    assert got == [entry(i) if i % 2 == 0 else None for i in range(128)]
    # client side: one pipeline of 130 commands, written once, then 130 replies read
    assert pipeline_executes == [130]
    assert single_commands == []
    assert events == ["send"] + ["read"] * 130
    # server side: every command arrived (and nothing else from the index did)
    assert after.get("cmdstat_getex", 0) - before.get("cmdstat_getex", 0) == 128
    assert after.get("cmdstat_hincrby", 0) - before.get("cmdstat_hincrby", 0) == 2
    assert idx.counters() == {"hits": 64, "misses": 64}
    idx.close()


def test_lookup_renews_ttl_of_hits_only(redis_url: str) -> None:
    idx = RedisIndex(redis_url, ttl_seconds=100)
    client = redis.Redis.from_url(redis_url)
    idx.register(NS, fp(1), entry(1))
    key = f"kvc:e:{NS}:{fp(1)}"
    client.pexpire(key, 5000)
    idx.lookup(NS, [fp(1), fp(2)])
    assert 99_000 < client.pttl(key) <= 100_000
    assert client.exists(f"kvc:e:{NS}:{fp(2)}") == 0  # a miss creates nothing
    client.close()
    idx.close()


def test_key_schema_has_no_hash_tags(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    idx.register(NS, fp(1), entry(1))
    idx.put_session("tenant:a", "s:1", b"r")
    idx.incr({"hits": 1})
    client = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in client.keys("*"))
    client.close()
    assert keys == ["kvc:counters", f"kvc:e:{NS}:{fp(1)}", "kvc:s:tenant%3Aa:s%3A1"]
    assert not any("{" in k for k in keys)
    idx.close()


def test_undecodable_entry_is_a_miss(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.set(f"kvc:e:{NS}:{fp(1)}", b"\xc1 not msgpack")
    client.close()
    assert idx.lookup(NS, [fp(1)]) == [None]
    assert idx.drop(NS, fp(1), object_key="segments/1") is False
    idx.close()


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
