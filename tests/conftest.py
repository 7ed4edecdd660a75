from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ceph import CephRGW, start_ceph_rgw
from tests.rclone import RcloneS3, start_rclone_s3
from tests.s3_servers import S3_SERVERS, S3Server
from tests.servers import MotoServer, RedisServer, s3_env, start_moto, start_redis
from tests.swift import SwiftS3, start_swift_s3


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A command run in-process (``kvcloud-worker serve`` configures logging before it
    listens) may leave a handler on the root logger bound to that test's captured stderr,
    which pytest closes: every later log record would then fail to print ("--- Logging
    error ---" in some other test's output). Each test gets the root logger as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


# Tests never touch real AWS credentials or the developer's config.
for _k, _v in s3_env("").items():
    os.environ[_k] = _v
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("KVCLOUD_SECRET", "test-master-secret")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = start_moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ceph_rgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephRGW]:
    """Ceph RGW (one monitor, one memstore OSD, the S3 gateway) for the session."""
    cluster = start_ceph_rgw(tmp_path_factory.mktemp("ceph"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def swift_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwiftS3]:
    """OpenStack Swift's S3 API: refuses conditional writes (501)."""
    server = start_swift_s3(tmp_path_factory.mktemp("swift"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RcloneS3]:
    """``rclone serve s3`` over a local directory: ignores conditional writes."""
    server = start_rclone_s3(tmp_path_factory.mktemp("rclone"))
    yield server
    server.stop()


@pytest.fixture
def s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """One of the session's S3 servers (``endpoint``, ``store_url(bucket, prefix)``,
    ``env()``), with its credentials in this process's environment for the test: boto3,
    kvcloud and the worker processes a test starts all pick them up."""
    server = request.getfixturevalue(S3_SERVERS[getattr(request, "param", "ceph")])
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database per test: FLUSHDB before handing it out."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    yield redis_server.url


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path
