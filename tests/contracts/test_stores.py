"""The store contract, run against every backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcloud.stores import FileStore, ObjectStore, S3Config, S3Store
from tests.contracts.store_contract import StoreContract
from tests.servers import MotoServer

# Left over in a developer's shell, these would point boto3 somewhere other than the mock.
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS")


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ObjectStore]:
        with FileStore(tmp_path / "objects") as s:
            yield s


class TestFileStoreFsync(StoreContract):
    """The fsync path shares the write code but takes extra syscalls; run it all once."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ObjectStore]:
        with FileStore(tmp_path / "objects", fsync=True) as s:
            yield s


class TestS3StoreMock(StoreContract):
    """In-process moto: fast, no sockets. With and without a key prefix."""

    @pytest.fixture(params=["", "segments/v1"], ids=["no-prefix", "prefix"])
    def store(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[ObjectStore]:
        from moto import mock_aws

        for var in _ENDPOINT_VARS:
            monkeypatch.delenv(var, raising=False)
        with mock_aws():
            config = S3Config(bucket="kvcloud-contract", prefix=request.param, create_bucket=True)
            with S3Store(config) as s:
                # A neighbour outside the prefix must never show up in list() or get().
                if request.param:
                    for key in ("outside", f"{request.param}x/leak"):
                        s._client.put_object(Bucket=config.bucket, Key=key, Body=b"x")
                yield s

    # moto's in-process backend checks If-None-Match and stores without a lock, and a racing
    # overwrite can raise ValueError inside moto itself: the race is covered against the
    # moto_server process below, so this class does not collect it at all.
    test_concurrent_puts_of_one_key = None  # type: ignore[assignment]


@pytest.mark.integration
class TestS3StoreMotoServer(StoreContract):
    """A real moto_server process over a socket; a fresh prefix per test keeps tests apart."""

    # moto_server honours If-None-Match: * but checks and writes in separate steps, so two
    # racing PUTs can both succeed (AWS S3 itself answers 412 or 409 to all but one).
    atomic_create = False

    @pytest.fixture
    def store(
        self, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[ObjectStore]:
        for var in _ENDPOINT_VARS:
            monkeypatch.delenv(var, raising=False)
        url = moto_server.store_url("kvcloud-contract", f"t-{uuid.uuid4().hex[:12]}")
        with S3Store.from_url(url + "&create_bucket=true") as s:
            yield s


class _OnServer(StoreContract):
    """A store on one of the session's S3 server processes (``server_fixture``), with that
    server's credentials; a fresh prefix per test keeps tests apart."""

    server_fixture: str

    @pytest.fixture
    def store(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[ObjectStore]:
        server = request.getfixturevalue(self.server_fixture)
        for var in _ENDPOINT_VARS:
            monkeypatch.delenv(var, raising=False)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        with S3Store.from_url(
            server.store_url("kvcloud-contract", f"t-{uuid.uuid4().hex[:12]}")
        ) as s:
            yield s


@pytest.mark.integration
class TestS3StoreCephRGW(_OnServer):
    """Ceph's S3 gateway (RGW 16.2 on a one-OSD memstore cluster, tests/ceph.py): a
    production S3 server."""

    server_fixture = "ceph_rgw"


class _WithoutConditionalWrites(_OnServer):
    """S3 servers that do not honour ``If-None-Match: *``: the store finds out on its first
    write and asks with a HEAD before each PUT, so an existing object is still reported and
    never rewritten. Two racing PUTs of one absent key can both write (the same bytes)."""

    atomic_create = False


@pytest.mark.integration
class TestS3StoreSwift(_WithoutConditionalWrites):
    """OpenStack Swift's s3api (tests/swift.py): answers 501 to a conditional PUT."""

    server_fixture = "swift_s3"


@pytest.mark.integration
class TestS3StoreRclone(_WithoutConditionalWrites):
    """``rclone serve s3`` (tests/rclone.py): accepts a conditional PUT and overwrites."""

    server_fixture = "rclone_s3"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("server_fixture", "found"),
    [
        ("moto_server", "honoured"),
        ("ceph_rgw", "honoured"),
        ("swift_s3", "refused"),
        ("rclone_s3", "ignored"),
    ],
)
def test_the_store_finds_what_the_server_does_with_conditional_writes(
    server_fixture: str, found: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcloud.stores import s3_writes

    server = request.getfixturevalue(server_fixture)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    s3_writes.forget()
    prefix = f"probe-{uuid.uuid4().hex[:12]}"
    url = server.store_url("kvcloud-contract", prefix)
    if "create_bucket" not in url:
        url += "&create_bucket=true"
    with S3Store.from_url(url) as s:
        assert s.put("ns/ab/obj", b"first") is True
        assert s.conditional_writes() == found
        assert s.put("ns/ab/obj", b"second") is False
        assert s.get("ns/ab/obj") == b"first"
        # the probe deleted its throwaway key again
        assert [i.key for i in s.list()] == ["ns/ab/obj"]
