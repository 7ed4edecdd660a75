"""The vLLM connector's settings and keys, without vLLM: extra config over KVCLOUD_*
variables, clear errors, tenants folded with cache_salt, and the checkpoint digest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcloud import ConfigError, derive_tenant_key
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.integrations.vllm.keys import checkpoint_digest, request_tenant


def test_extra_config_wins_over_environment() -> None:
    env = {"KVCLOUD_STORE": "file:///env", "KVCLOUD_CHUNK_TOKENS": "512", "KVCLOUD_TENANT": "t"}
    cfg = VLLMConnectorConfig.load({"chunk_tokens": 128}, env=env)
    assert (cfg.store, cfg.chunk_tokens, cfg.tenant) == ("file:///env", 128, "t")
    assert VLLMConnectorConfig.load({}, env={}).write_policy == "write-through"


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({"chunk_size": 1}, {}, "unknown kv_connector_extra_config key 'chunk_size'"),
        ({"secret": "x"}, {}, "set KVCLOUD_SECRET"),
        ({"chunk_tokens": 0}, {}, "chunk_tokens must be a positive integer"),
        ({"write_policy": "write-back"}, {}, "write_policy 'write-back'"),
        ({}, {"KVCLOUD_LOAD_TIMEOUT": "soon"}, "KVCLOUD_LOAD_TIMEOUT"),
        ({"load_timeout": -1}, {}, "load_timeout must be a positive number"),
    ],
)
def test_bad_settings_are_named(extra: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        VLLMConnectorConfig.load(extra, env=env)


def test_client_config_takes_secret_from_environment_only() -> None:
    cfg = VLLMConnectorConfig.load({"store": "file:///s", "index": "sqlite:///i.db"}, env={})
    client = cfg.client_config(env={"KVCLOUD_SECRET": "from-env"})
    assert client.secret == b"from-env"
    assert (client.store, client.index) == ("file:///s", "sqlite:///i.db")


def test_cache_salt_gives_another_tenant_key() -> None:
    base = request_tenant("acme", None)
    one, two = request_tenant("acme", "s1"), request_tenant("acme", "s2")
    assert base == "acme" and len({base, one, two}) == 3
    assert request_tenant("acme", "s1") == one  # deterministic across processes
    keys = {derive_tenant_key(b"secret", t) for t in (base, one, two)}
    assert len(keys) == 3


def test_checkpoint_digest_follows_content_not_folder(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(b"weights" * 100)
    (a / "config.json").write_text('{"model_type": "llama"}')
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(b))
    (b / "model.safetensors").write_bytes(b"weightz" * 100)
    assert checkpoint_digest(str(a)) != checkpoint_digest(str(b))
    before = checkpoint_digest(str(a))
    (a / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert checkpoint_digest(str(a)) != before  # the config changes the KV too
    with pytest.raises(ConfigError, match="no weight files"):
        checkpoint_digest(str(tmp_path))
