"""kvcloud.probe: real write/read/delete probes of a store and an index, bounded in time, and
one distinct line per way a deployment is commonly broken. Against real servers where they
are cheap (redis-server, moto_server), closed ports and a port that never answers."""

from __future__ import annotations

import hashlib
import hmac
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcloud.config import KVCloudConfig
from kvcloud.errors import ConfigError, ProbeError
from kvcloud.indexes import SQLiteIndex
from kvcloud.namespace import derive_tenant_key
from kvcloud.probe import (
    PROBE_PREFIX,
    PROBE_SCOPE,
    key_id,
    probe,
    probe_index,
    probe_store,
    require_index,
    require_store,
)
from kvcloud.sessions import unpack_record
from kvcloud.stores import FileStore
from tests.servers import MotoServer, free_port, start_redis


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture
def embedded(tmp_path: Path) -> KVCloudConfig:
    return KVCloudConfig(store=f"file://{tmp_path / 'o'}", index=f"sqlite://{tmp_path / 'i.db'}")


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A port that accepts connections (the kernel completes the handshake into the listen
    backlog) and never answers: what a wedged server or a black-holing proxy looks like."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# --- key id ------------------------------------------------------------------------------------


def test_key_id_is_a_short_one_way_name_of_the_tenant_key() -> None:
    kid = key_id(b"secret-a", "default")
    assert len(kid) == 12 and int(kid, 16) >= 0
    assert kid == key_id(b"secret-a", "default")  # every pod computes the same
    assert kid != key_id(b"secret-b", "default") and kid != key_id(b"secret-a", "other")
    tenant_key = derive_tenant_key(b"secret-a", "default")
    assert kid == hmac.new(tenant_key, b"kvcloud-key-id-v1", hashlib.sha256).hexdigest()[:12]
    # neither the key nor the secret shows through
    assert kid not in tenant_key.hex() and "secret" not in kid


# --- success -----------------------------------------------------------------------------------


def test_probe_embedded_round_trips_and_leaves_nothing(embedded: KVCloudConfig) -> None:
    report = probe(embedded, timeout=10)
    assert set(report.store_seconds) == {"put", "get", "delete"}
    assert report.index_seconds > 0 and report.seconds >= report.index_seconds
    assert report.key_id == key_id(embedded.secret, embedded.tenant)
    assert report.store == embedded.store and report.index == embedded.index
    with embedded.open_store() as store, embedded.open_index() as index:
        assert list(store.list(PROBE_PREFIX)) == []
        assert list(index.iter_sessions()) == []


def test_probe_moto_and_redis(moto_server: MotoServer, redis_url: str) -> None:
    store = moto_server.store_url("probe-ok") + "&create_bucket=true"
    report = probe(KVCloudConfig(store=store, index=redis_url), timeout=30)
    assert report.store_seconds["put"] > 0 and report.index_seconds > 0
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0  # the record is deleted, not left to expire
    client.close()


def test_the_index_probe_record_is_a_valid_empty_session(tmp_path: Path) -> None:
    """Seen mid-probe by verify or gc, it is a healthy session naming no object."""
    seen: list[bytes] = []

    class Spy(SQLiteIndex):
        def put_session(self, scope, session_id, record, ttl_seconds=None):  # type: ignore[no-untyped-def]
            assert scope == PROBE_SCOPE and ttl_seconds and ttl_seconds <= 60
            seen.append(record)
            super().put_session(scope, session_id, record, ttl_seconds)

    with Spy(tmp_path / "i.db") as index:
        probe_index(index)
    rec = unpack_record("x", seen[0])
    assert rec.object_keys == [] and rec.n_tokens == 0


def test_a_store_that_corrupts_bytes_fails_the_probe(tmp_path: Path) -> None:
    class Corrupting(FileStore):
        def get(self, key: str) -> bytes:
            return b"\x00" + super().get(key)[1:]

    store = Corrupting(tmp_path / "o")
    with pytest.raises(ProbeError, match="different bytes") as info:
        probe_store(store)
    assert info.value.target == "store" and "corrupts" in info.value.fix
    assert list(store.list()) == []  # cleaned up after the failure too


# --- failures: one distinct line each ----------------------------------------------------------


def test_closed_ports(tmp_path: Path) -> None:
    port = free_port()
    cfg = KVCloudConfig(
        store=f"file://{tmp_path / 'o'}",
        index=f"redis://:hunter2@127.0.0.1:{port}/0",
        connect_timeout=0.5,
    )
    start = time.monotonic()
    with pytest.raises(ProbeError) as info:
        probe(cfg, timeout=10)
    assert time.monotonic() - start < 5
    text = _one_line(info.value)
    assert info.value.target == "index" and "cannot connect" in text
    assert f"127.0.0.1:{port}" in text and "hunter2" not in text and "redis-server" in text

    store = f"s3://b/p?endpoint_url=http://127.0.0.1:{port}&region=us-east-1&max_attempts=1"
    cfg = KVCloudConfig(store=store, index=f"sqlite://{tmp_path / 'i.db'}", connect_timeout=0.5)
    with pytest.raises(ProbeError) as info:
        probe(cfg, timeout=10)
    text = _one_line(info.value)
    assert info.value.target == "store" and "cannot connect" in text and "endpoint_url" in text


@pytest.mark.parametrize("target", ["store", "index"])
def test_a_server_that_never_answers_costs_the_timeout_not_more(
    target: str, hung_port: int, tmp_path: Path
) -> None:
    hung = {
        "store": f"s3://b/p?endpoint_url=http://127.0.0.1:{hung_port}&region=us-east-1",
        "index": f"redis://127.0.0.1:{hung_port}/0",
    }
    cfg = KVCloudConfig(
        store=hung["store"] if target == "store" else f"file://{tmp_path / 'o'}",
        index=hung["index"] if target == "index" else f"sqlite://{tmp_path / 'i.db'}",
        read_timeout=60,  # the backends alone would wait a minute (times their retries)
    )
    start = time.monotonic()
    with pytest.raises(ProbeError) as info:
        probe(cfg, timeout=1.0)
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 3.0
    text = _one_line(info.value)
    assert info.value.target == target and "did not answer within 1 s" in text
    assert f"127.0.0.1:{hung_port}" in text


def test_wrong_redis_password(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "r", extra=["--requirepass", "right-pw"])
    try:
        cfg = KVCloudConfig(
            store=f"file://{tmp_path / 'o'}",
            index=f"redis://:wrong-pw@127.0.0.1:{server.port}/0",
        )
        with pytest.raises(ProbeError) as info:
            probe(cfg, timeout=10)
    finally:
        server.stop()
    text = _one_line(info.value)
    assert info.value.target == "index" and "refused the password" in text
    assert "wrong-pw" not in text and "redis://:***@" in text


def test_read_only_replica(tmp_path: Path) -> None:
    """A replica (of a primary that is not even up) refuses writes: READONLY."""
    server = start_redis(tmp_path / "r", extra=["--replicaof", "127.0.0.1", str(free_port())])
    try:
        cfg = KVCloudConfig(store=f"file://{tmp_path / 'o'}", index=server.url)
        with pytest.raises(ProbeError) as info:
            probe(cfg, timeout=10)
    finally:
        server.stop()
    assert "read-only replica" in _one_line(info.value) and "primary" in info.value.fix


def test_missing_bucket(moto_server: MotoServer, tmp_path: Path) -> None:
    cfg = KVCloudConfig(
        store=moto_server.store_url("probe-no-such-bucket"), index=f"sqlite://{tmp_path / 'i.db'}"
    )
    with pytest.raises(ProbeError) as info:
        probe(cfg, timeout=30)
    text = _one_line(info.value)
    assert info.value.target == "store" and "bucket does not exist" in text
    assert "create_bucket=true" in info.value.fix


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto_server checking every request's signature against IAM (which knows no user):
    the credentials are refused, as AWS and MinIO refuse unknown keys."""
    work = tmp_path_factory.mktemp("iam-moto")
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    argv = ["env", "INITIAL_NO_AUTH_ACTION_COUNT=0", str(exe), "-H", "127.0.0.1", "-p", str(port)]
    server = MotoServer(argv=argv, port=port, log_path=work / "moto.log")
    server.start()
    yield server
    server.stop()


def test_refused_credentials(iam_moto: MotoServer, tmp_path: Path) -> None:
    cfg = KVCloudConfig(store=iam_moto.store_url("b"), index=f"sqlite://{tmp_path / 'i.db'}")
    with pytest.raises(ProbeError) as info:
        probe(cfg, timeout=30)
    text = _one_line(info.value)
    assert info.value.target == "store" and "refused the credentials" in text
    assert "HTTP 403" in text and "AWS_ACCESS_KEY_ID" in info.value.fix


def test_probe_is_a_config_error_with_its_parts() -> None:
    exc = ProbeError("store", "s3://b/p", "the bucket does not exist", "create it")
    assert isinstance(exc, ConfigError)
    assert str(exc) == "store s3://b/p: the bucket does not exist; fix: create it"
    with pytest.raises(ConfigError):
        probe(KVCloudConfig(), timeout=0)


# --- readers never create ----------------------------------------------------------------------


def test_must_exist_opening_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "a" / "b"
    with pytest.raises(ConfigError, match="no store at file://"):
        FileStore(missing, create=False)
    with pytest.raises(ConfigError, match="no store at"):
        require_store(f"file://{missing}")
    with pytest.raises(ConfigError, match="no index at sqlite://"):
        SQLiteIndex(missing / "i.db", create=False)
    with pytest.raises(ConfigError, match="no index at"):
        require_index(f"sqlite://{missing / 'i.db'}")
    assert not (tmp_path / "a").exists()
    # a file that is not a kvcloud index is not made into one
    other = tmp_path / "other.db"
    other.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a kvcloud index"):
        SQLiteIndex(other, create=False)
    assert other.read_bytes() == b""
    (tmp_path / "junk.db").write_bytes(b"x" * 4096)
    with pytest.raises(ConfigError, match="not a kvcloud index"):
        require_index(f"sqlite://{tmp_path / 'junk.db'}")
    # existing ones open as usual; other schemes create nothing on open and pass
    SQLiteIndex(tmp_path / "i.db").close()
    SQLiteIndex(tmp_path / "i.db", create=False).close()
    FileStore(tmp_path / "o")
    FileStore(tmp_path / "o", create=False)
    require_store("s3://b/p?endpoint_url=http://127.0.0.1:9")
    require_index("redis://127.0.0.1:9/0")
