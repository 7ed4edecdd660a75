"""What the vLLM connector says and checks at start (kvcloud/integrations/vllm/startup.py):
the embedded default is a warning naming it, ``require`` refuses it, the insecure default
secret and backends that fail a real probe, each with one line, bounded in time; the
identity a dashboard compares servers by names no secret."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from kvcloud.errors import ConfigError, KVCloudError
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.startup import (
    INFO_LABELS,
    check_at_start,
    identity,
    info_labels,
)
from kvcloud.namespace import key_id

SECRET = "startup-secret"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _load(env: dict[str, str], **extra: object) -> tuple[VLLMConnectorConfig, object]:
    cfg = VLLMConnectorConfig.load(extra, env)
    return cfg, cfg.client_config(env)


def test_the_embedded_default_is_a_warning_that_names_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where the default lives
    env = {"KVCLOUD_SECRET": SECRET}
    cfg, client = _load(env)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcloud"):
        check_at_start(cfg, client)  # type: ignore[arg-type]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "KVCLOUD_STORE and KVCLOUD_INDEX unset" in line
    assert str(tmp_path) in line and "shares KV with no other server" in line
    # set both: silent
    caplog.clear()
    env |= {"KVCLOUD_STORE": f"file://{tmp_path}/o", "KVCLOUD_INDEX": f"sqlite://{tmp_path}/i"}
    cfg, client = _load(env)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcloud"):
        check_at_start(cfg, client)  # type: ignore[arg-type]
    assert caplog.records == []


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, "KVCLOUD_STORE and KVCLOUD_INDEX are unset"),
        ({"KVCLOUD_STORE": "file:///srv/kv"}, "KVCLOUD_INDEX is unset"),
    ],
)
def test_require_refuses_the_embedded_default(
    tmp_path: Path, env: dict[str, str], names: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = {"KVCLOUD_SECRET": SECRET, **env}
    cfg, client = _load(env, require=True)
    with pytest.raises(ConfigError, match=names) as info:
        check_at_start(cfg, client)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert not (tmp_path / "kvcloud").exists()  # refused before anything was created


def test_require_refuses_the_insecure_default_secret(tmp_path: Path) -> None:
    env = {"KVCLOUD_STORE": f"file://{tmp_path}/o", "KVCLOUD_INDEX": f"sqlite://{tmp_path}/i"}
    cfg, client = _load(env, require=True)
    with pytest.raises(ConfigError, match="KVCLOUD_SECRET is unset"):
        check_at_start(cfg, client)  # type: ignore[arg-type]


def test_require_probes_the_backends_and_passes_healthy_ones(tmp_path: Path) -> None:
    env = {
        "KVCLOUD_STORE": f"file://{tmp_path}/o",
        "KVCLOUD_INDEX": f"sqlite://{tmp_path}/i.db",
        "KVCLOUD_SECRET": SECRET,
    }
    cfg, client = _load(env, require=True)
    check_at_start(cfg, client)  # type: ignore[arg-type]
    # the probe cleaned up after itself: no object left in the store
    assert [p for p in (tmp_path / "o").rglob("*") if p.is_file()] == []


def test_require_refuses_an_unreachable_index_in_bounded_time(tmp_path: Path) -> None:
    env = {
        "KVCLOUD_STORE": f"file://{tmp_path}/o",
        "KVCLOUD_INDEX": f"redis://127.0.0.1:{_closed_port()}/0",
        "KVCLOUD_SECRET": SECRET,
        "KVCLOUD_CONNECT_TIMEOUT": "0.5",
        "KVCLOUD_READ_TIMEOUT": "0.5",
    }
    cfg, client = _load(env, require=True)
    t0 = time.monotonic()
    with pytest.raises(KVCloudError) as info:
        check_at_start(cfg, client)  # type: ignore[arg-type]
    assert time.monotonic() - t0 <= cfg.probe_timeout + 1
    message = str(info.value)
    assert "\n" not in message and "index" in message and "127.0.0.1" in message


def test_require_refuses_a_hung_store_within_its_bound(tmp_path: Path) -> None:
    # a server that accepts the connection and never answers
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    port = hung.getsockname()[1]
    env = {
        "KVCLOUD_STORE": f"s3://b?endpoint_url=http://127.0.0.1:{port}&region=us-east-1",
        "KVCLOUD_INDEX": f"sqlite://{tmp_path}/i.db",
        "KVCLOUD_SECRET": SECRET,
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "KVCLOUD_CONNECT_TIMEOUT": "0.3",
        "KVCLOUD_READ_TIMEOUT": "0.3",
    }
    cfg, client = _load(env, require=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(KVCloudError) as info:
            check_at_start(cfg, client)  # type: ignore[arg-type]
    finally:
        hung.close()
    assert time.monotonic() - t0 <= cfg.probe_timeout + 1
    assert "store" in str(info.value) and "\n" not in str(info.value)


def test_the_identity_names_no_secret() -> None:
    env = {
        "KVCLOUD_STORE": "s3://b/p?endpoint_url=http://s3:9000",
        "KVCLOUD_INDEX": "redis://:hunter2@redis:6379/0",
        "KVCLOUD_SECRET": SECRET,
        "KVCLOUD_TENANT": "acme",
        "KVCLOUD_LOAD_MODE": "sync",
    }
    cfg, client = _load(env)
    ident = identity(cfg, client)  # type: ignore[arg-type]
    assert set(ident) == set(INFO_LABELS)
    assert ident["key_id"] == key_id(SECRET.encode(), "acme")
    assert ident["load_mode"] == "sync" and ident["tenant"] == "acme"
    assert "hunter2" not in repr(ident) and SECRET not in repr(ident)
    # as vLLM's API server process computes it for vllm:kvcloud_info
    assert info_labels({"load_mode": "sync"}, env) == ident
    assert info_labels({"no_such_key": 1}, env) == dict.fromkeys(INFO_LABELS, "invalid")
    # another secret or tenant: another id (those servers would not share)
    assert key_id(b"other", "acme") != ident["key_id"] != key_id(SECRET.encode(), "default")
    # the insecure default secret says so
    unset = {k: v for k, v in env.items() if k != "KVCLOUD_SECRET"}
    cfg, client = _load(unset)
    assert identity(cfg, client)["key_id"].endswith("(insecure default secret)")  # type: ignore[arg-type]
