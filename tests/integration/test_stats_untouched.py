"""The exporter's reads leave Redis as they found it: no entry's LRU clock moves (CLIENT
NO-TOUCH, checked with OBJECT IDLETIME against a control that does move it), no TTL slides,
on real servers; and a server without NO-TOUCH (Redis 7.0) is warned about, not fatal."""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
from collections.abc import Iterator

import pytest
import redis

from kvcloud.indexes import IndexEntry, RedisIndex, redis_stats
from kvcloud.tools.cli.stats import collect_stats, collect_summary
from tests.servers import RedisServer, start_redis

pytestmark = pytest.mark.integration

NS = "ns0123456789abcdef"


def fp(i: int) -> str:
    """A fingerprint as real ones are: a hash, so entries spread over the buckets."""
    return hashlib.sha256(str(i).encode()).hexdigest()


@pytest.fixture(scope="module", params=["redis8", "valkey9"])
def touchless_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """Servers that have CLIENT NO-TOUCH, evicting by LRU as production does."""
    server = start_redis(
        tmp_path_factory.mktemp(request.param),
        flavor=request.param,
        extra=["--maxmemory-policy", "volatile-lru"],
    )
    yield server
    server.stop()


def _fill(url: str) -> None:
    with RedisIndex(url, ttl_seconds=3600) as idx:
        for start in range(0, 300, 100):
            idx.register_many(
                NS,
                [
                    (fp(i), IndexEntry(f"segments/{NS}/{i:02x}/{i:064x}", 256, 1000, 1.0))
                    for i in range(start, start + 100)
                ],
            )
        idx.put_session("tenant", "s1", b"record")
        idx.flush()


def _args(url: str) -> argparse.Namespace:
    return argparse.Namespace(store=None, index=url, no_store=True)


def _idle(client: redis.Redis, keys: list[bytes]) -> dict[bytes, int]:
    """OBJECT IDLETIME of each key (OBJECT itself touches nothing)."""
    return {key: int(client.object("idletime", key)) for key in keys}


def _expiries(url: str) -> dict[str, float | None]:
    with RedisIndex(url + "&no_touch=on", ttl_seconds=3600) as idx:
        return {r.fp: r.expires_at for r in idx.iter_entries()}


def test_stats_leave_lru_clocks_and_ttls_alone(touchless_server: RedisServer) -> None:
    # 16 buckets, so that the sample reads every one of them
    url = touchless_server.url + "?buckets=16"
    client = redis.Redis.from_url(touchless_server.url)
    client.flushdb()
    _fill(url)
    keys = sorted(
        k for k in client.scan_iter(match="kvc:*") if k.startswith((b"kvc:h:", b"kvc:s:"))
    )
    assert len(keys) == 17  # 16 buckets and a session
    expiries = _expiries(url)
    time.sleep(2.2)  # the LRU clock has a resolution of a second
    assert min(_idle(client, keys).values()) >= 2

    summary = collect_summary(_args(url), 512)
    full = collect_stats(_args(url), show=False)
    assert summary["lru_untouched"] is True
    assert summary["entries"] == full["entries"] == 300
    assert summary["sample"][NS]["entries"] == 300  # every bucket was read...
    idle = _idle(client, keys)
    assert min(idle.values()) >= 2, f"a stats read reset an LRU clock: {idle}"  # ...untouched
    time.sleep(0.3)  # any renewal would have been sent by now
    after = _expiries(url)  # (field TTLs are read as now + time left: to the millisecond)
    assert after.keys() == expiries.keys()
    assert all(after[fp] == pytest.approx(t, abs=0.05) for fp, t in expiries.items()), (
        "a stats read slid a TTL"
    )

    # the control: the same reads without NO-TOUCH do move the clocks
    with RedisIndex(url, ttl_seconds=3600) as plain:
        plain.summary(512)
        list(plain.iter_sessions())
    assert max(_idle(client, keys).values()) <= 1
    client.close()


def test_a_server_without_no_touch_is_warned_about(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis 7.0 refuses CLIENT NO-TOUCH: the figures come all the same, with one warning
    (not one per collection) and kvcloud_stats_lru_untouched 0."""
    monkeypatch.setattr(redis_stats, "REFUSED_NO_TOUCH", set())
    _fill(redis_url)
    with caplog.at_level(logging.WARNING, logger="kvcloud.index"):
        results = [collect_summary(_args(redis_url), 64) for _ in range(3)]
    assert all(r["entries"] == 300 and r["lru_untouched"] is False for r in results)
    assert sum("NO-TOUCH" in r.getMessage() for r in caplog.records) == 1


def test_exporter_cost_does_not_depend_on_the_entries(redis_url: str) -> None:
    """The commands one collection sends do not grow with the entries (the bench measures
    time at 10^6 entries: docs/bench/exporter.json)."""
    client = redis.Redis.from_url(redis_url)
    url = redis_url + "?buckets=16"  # one SCAN call counts the sessions at either size

    def commands() -> int:
        stats = client.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")

    sent = []
    for n in (100, 3000):
        client.flushdb()
        with RedisIndex(url, ttl_seconds=3600) as idx:
            for start in range(0, n, 500):
                idx.register_many(
                    NS,
                    [
                        (fp(i), IndexEntry(f"segments/{NS}/00/{i:064x}", 256, 1000, 1.0))
                        for i in range(start, min(n, start + 500))
                    ],
                )
            idx.flush()
        collect_summary(_args(url), 0)
        before = commands()
        result = collect_summary(_args(url), 0)
        sent.append(commands() - before)
        assert result["entries"] == n
    assert sent[0] == sent[1], sent
    client.close()
