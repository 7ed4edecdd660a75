"""A local 3-master Redis Cluster, started once for the tests in this directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults import report
from tests.servers import RedisClusterServers, start_redis_cluster

# the reliability log: each test's observation and outcome (see tests/faults/report.py)
pytest_runtest_makereport = report.pytest_runtest_makereport
reliability = report.reliability


@pytest.fixture(scope="session")
def redis_cluster_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterServers]:
    servers = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield servers
    servers.stop()


@pytest.fixture
def redis_cluster(redis_cluster_servers: RedisClusterServers) -> RedisClusterServers:
    """The cluster, emptied (FLUSHALL on every master) for this test."""
    redis_cluster_servers.flushall()
    return redis_cluster_servers
