"""One variable, one meaning: every KVCLOUD_* variable that several components read has the
same default in each (or a difference stated here with its reason), and every value
.env.example sets is valid for every component that reads it. The readers are the
dataclasses whose fields name their variable (``metadata={"env": NAME}``)."""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import pytest

from kvcloud.config import INSECURE_DEFAULT_SECRET, KVCloudConfig, env_values
from kvcloud.errors import ConfigError
from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from tests.unit.test_compose import _env_example
from workers.config import WorkerOptions

ROOT = Path(__file__).resolve().parents[2]

# every dataclass that reads KVCLOUD_* variables, by the file that defines it
READERS: dict[str, type] = {
    "kvcloud/config.py": KVCloudConfig,
    "kvcloud/integrations/vllm/config.py": VLLMConnectorConfig,
    "workers/config.py": WorkerOptions,
}

# Defaults that differ on purpose, and why. Each must still differ (or it leaves this list).
BY_DESIGN = {
    (WorkerOptions, "KVCLOUD_WRITE_POLICY"): "vLLM tells a connector nothing about evictions, "
    "so the connector cannot write back; the kvcloud worker keeps the seed's write-back",
    (WorkerOptions, "KVCLOUD_STORE"): "unset, a kvcloud worker runs with its local cache only",
    (WorkerOptions, "KVCLOUD_INDEX"): "unset, a kvcloud worker runs with its local cache only",
}


def _worker_dev_secret() -> bytes:
    """What a worker without KVCLOUD_SECRET uses (workers/engine/engine.py, read without
    importing it: it pulls in torch)."""
    tree = ast.parse((ROOT / "workers/engine/engine.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_DEV_SECRET":
            return str(ast.literal_eval(node.value)).encode()
    raise AssertionError("workers/engine/engine.py no longer defines _DEV_SECRET")


# An empty default means "unset: fall back"; what each reader then really uses.
FALLBACKS = {
    (VLLMConnectorConfig, "KVCLOUD_STORE"): lambda: (
        VLLMConnectorConfig.load(env={}).client_config(env={}).store
    ),
    (VLLMConnectorConfig, "KVCLOUD_INDEX"): lambda: (
        VLLMConnectorConfig.load(env={}).client_config(env={}).index
    ),
    (WorkerOptions, "KVCLOUD_SECRET"): _worker_dev_secret,
}


def _env_fields(cls: type) -> dict[str, Field[Any]]:
    return {f.metadata["env"]: f for f in fields(cls) if f.metadata.get("env")}


def _default(cls: type, var: str) -> Any:
    if (cls, var) in FALLBACKS:
        return FALLBACKS[(cls, var)]()
    f = _env_fields(cls)[var]
    if f.default is not MISSING:
        return f.default
    assert f.default_factory is not MISSING, f"{cls.__name__}.{f.name} has no default"
    return f.default_factory()


def _shared() -> dict[str, list[type]]:
    readers: dict[str, list[type]] = {}
    for cls in READERS.values():
        for var in _env_fields(cls):
            readers.setdefault(var, []).append(cls)
    return {var: classes for var, classes in readers.items() if len(classes) > 1}


def test_the_readers_are_every_dataclass_that_reads_the_environment() -> None:
    """A new configuration dataclass joins READERS (and so these checks)."""
    found = {
        str(path.relative_to(ROOT))
        for top in ("kvcloud", "workers")
        for path in (ROOT / top).rglob("*.py")
        if re.search(r"metadata=\{\"env\"", path.read_text())
    }
    assert found == set(READERS)


def test_a_variable_read_in_several_places_has_one_default() -> None:
    shared = _shared()
    assert "KVCLOUD_READ_TIMEOUT" in shared and "KVCLOUD_TENANT" in shared
    for var, classes in shared.items():
        values = {
            cls.__name__: _default(cls, var) for cls in classes if (cls, var) not in BY_DESIGN
        }
        first = next(iter(values.values()))
        assert all(v == first for v in values.values()), f"{var}: {values}"
        for cls in classes:
            if (cls, var) in BY_DESIGN:
                assert _default(cls, var) != first, f"{var} in {cls.__name__} no longer differs"
    assert KVCloudConfig().read_timeout == VLLMConnectorConfig().read_timeout == 5.0
    assert _worker_dev_secret() == INSECURE_DEFAULT_SECRET


def _build(cls: type, env: dict[str, str]) -> Any:
    if cls is VLLMConnectorConfig:
        return VLLMConnectorConfig.load(env=env)
    return cls.from_env(env)  # type: ignore[attr-defined]


def test_every_value_of_env_example_is_valid_for_every_reader() -> None:
    """Sourcing .env into a shell hands every variable to whatever runs there."""
    example = {k: v for k, v in _env_example().items() if k.startswith("KVCLOUD_")}
    assert example
    read_somewhere = set()
    for cls in READERS.values():
        mine = {k: v for k, v in example.items() if k in _env_fields(cls)}
        read_somewhere |= set(mine)
        # all of them at once (a sourced .env) ...
        obj = _build(cls, example)
        # ... and each one alone, which also shows it is read as written
        for var, value in mine.items():
            one = _build(cls, {var: value})
            name = _env_fields(cls)[var].name
            expected = env_values(cls, {var: value}).get(name, getattr(cls(), name))
            if name == "secret" and cls is KVCloudConfig:
                expected = value.encode()
            assert getattr(one, name) == getattr(obj, name) == expected, (cls.__name__, var)
    # the rest only fill in docker-compose.yml (bucket, endpoint, S3 user, models folder)
    assert set(example) - read_somewhere <= {
        "KVCLOUD_BUCKET",
        "KVCLOUD_S3_ENDPOINT",
        "KVCLOUD_S3_REGION",
        "KVCLOUD_S3_ACCESS_KEY",
        "KVCLOUD_S3_SECRET_KEY",
        "KVCLOUD_MODELS_DIR",
    }
    # the connector also builds its client from the same environment
    VLLMConnectorConfig.load(env=example).client_config(env=example)


def test_the_worker_only_write_policy_is_refused_by_the_connector() -> None:
    """Why .env.example leaves KVCLOUD_WRITE_POLICY empty: write-back is the worker's."""
    assert WorkerOptions.from_env({"KVCLOUD_WRITE_POLICY": "write-back"}).write_policy
    with pytest.raises(ConfigError, match="write-back"):
        VLLMConnectorConfig.load(env={"KVCLOUD_WRITE_POLICY": "write-back"})
    for both in ("write-through", "off"):
        assert VLLMConnectorConfig.load(env={"KVCLOUD_WRITE_POLICY": both}).write_policy == both
        assert WorkerOptions.from_env({"KVCLOUD_WRITE_POLICY": both}).write_policy == both
