"""docker-compose.yml's vLLM services (profiles ``gpu`` and ``cpu``), without Docker: the file
validates against the compose-spec schema; each vLLM's environment, as compose would make it
from .env.example, is parsed by the connector's own settings into the stack's store, index
(with the Redis password) and secret, with the bucket-limited S3 user; and vLLM's own
argument parser accepts each service's command. (tests/unit/test_compose.py checks the rest
of the stack.)"""

from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from kvcloud.stores import S3Config
from scripts.fleet.vllm_fleet import kvcloud_transfer_config
from tests.deploy.test_images import IMAGES, build_args
from tests.deploy.vllm_args import parse_vllm_args
from tests.unit.test_compose import (
    COMPOSE,
    _container_ports,
    _env_example,
    _interpolate,
    _service_env,
)

PROFILES = {"gpu": ("vllm-gpu-a", "vllm-gpu-b"), "cpu": ("vllm-cpu-a", "vllm-cpu-b")}
VLLM = tuple(name for names in PROFILES.values() for name in names)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return _env_example()


def compose_schema() -> dict[str, Any]:
    """The compose-spec schema, as check-jsonschema vendors it (no download)."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def test_compose_file_validates_against_the_compose_spec(compose: dict[str, Any]) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    # and the check can fail: a misspelt key and a value of the wrong type are rejected
    broken = json.loads(json.dumps(compose))
    broken["services"]["vllm-gpu-a"]["helthcheck"] = {}
    broken["services"]["redis"]["depends_on"] = 5
    assert len(list(validator.iter_errors(broken))) >= 2


def test_profiles_hold_two_vllms_each(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for profile, names in PROFILES.items():
        for name in names:
            assert services[name]["profiles"] == [profile], name
    # the default `docker compose up` starts no vLLM: every other service has no profile
    assert all(not s.get("profiles") for n, s in services.items() if n not in VLLM)


def test_vllm_environment_is_the_stacks_store_index_and_secret(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    init = _service_env(services["minio-init"], env_example)
    worker = _service_env(services["worker-1"], env_example)
    for name in VLLM:
        env = _service_env(services[name], env_example)
        # every KVCLOUD_* variable set is one the connector reads
        read = {f.metadata["env"] for f in VLLMConnectorConfig.__dataclass_fields__.values()} | {
            "KVCLOUD_SECRET",
            "KVCLOUD_TTL_SECONDS",
        }
        unknown = sorted(k for k in env if k.startswith("KVCLOUD_") and k not in read)
        assert not unknown, f"{name} sets variables the connector does not read: {unknown}"
        cfg = VLLMConnectorConfig.load(env=env)
        client = cfg.client_config(env)
        assert not client.insecure_secret, name
        assert client.secret == env_example["KVCLOUD_SECRET"].encode()
        assert cfg.write_policy == "write-through", "the connector's writes, not the worker's"
        # the workers' store and index: one fleet
        assert client.store == worker["KVCLOUD_STORE"] and client.index == worker["KVCLOUD_INDEX"]
        s3 = S3Config.from_url(client.store, env={})
        assert s3.bucket == init["KVCLOUD_BUCKET"]
        assert urlsplit(s3.endpoint_url or "").hostname == "minio"
        index = urlsplit(client.index)
        assert (index.hostname, index.password) == ("redis", env_example["REDIS_PASSWORD"])
        # the bucket-limited user minio-init creates, never MinIO's root
        assert env["AWS_ACCESS_KEY_ID"] == init["KVCLOUD_S3_ACCESS_KEY"]
        assert env["AWS_SECRET_ACCESS_KEY"] == init["KVCLOUD_S3_SECRET_KEY"]
        assert env["AWS_ACCESS_KEY_ID"] != env_example["MINIO_ROOT_USER"]


def test_vllm_services_run_the_images_with_what_vllm_needs(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    gpus = []
    for name in VLLM:
        svc = services[name]
        kind = "vllm-gpu" if name.startswith("vllm-gpu") else "vllm-cpu"
        assert svc["build"]["dockerfile"] == f"infra/images/{kind}/Dockerfile", name
        assert svc["image"].startswith(f"kvcloud/{kind}:"), name
        deps = svc["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["minio-init"]["condition"] == "service_completed_successfully"
        assert "${KVCLOUD_MODELS_DIR:-./models}:/models:ro" in svc["volumes"]
        # vLLM's processes share tensors through /dev/shm
        assert svc.get("ipc") == "host" or svc.get("shm_size"), name
        health = " ".join(svc["healthcheck"]["test"])
        assert "http://127.0.0.1:8000/health" in health, name
        assert _container_ports(svc, env_example) == {8000}
        grace = int(str(svc["stop_grace_period"]).rstrip("s"))
        shutdown = int(svc["command"][svc["command"].index("--shutdown-timeout") + 1])
        assert grace > shutdown, f"{name}: killed before the connector stores the last answers"
        if kind == "vllm-gpu":
            (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
            gpus.append(_interpolate(device["device_ids"][0], env_example))
            # the base image compose passes is the Dockerfile's default
            base = build_args((IMAGES / kind / "Dockerfile").read_text())["VLLM_IMAGE"]
            arg = svc["build"]["args"]["VLLM_IMAGE"]
            assert re.fullmatch(r"\$\{VLLM_GPU_BASE_IMAGE:-(.+)\}", arg).group(1) == base
            assert env_example["VLLM_GPU_BASE_IMAGE"] == base
    assert gpus[0] != gpus[1], "both GPU servers would share one GPU"


def test_vllm_accepts_each_command(compose: dict[str, Any], env_example: dict[str, str]) -> None:
    services = compose["services"]
    argvs = [[_interpolate(a, env_example) for a in services[n]["command"]] for n in VLLM]
    parsed = parse_vllm_args(argvs)
    reference = kvcloud_transfer_config()
    for name, args in zip(VLLM, parsed, strict=True):
        assert args["model"] == f"/models/{env_example['VLLM_MODEL']}", name
        assert (args["host"], args["port"]) == ("0.0.0.0", 8000), name
        assert args["enable_prompt_tokens_details"], name
        assert args["kv_connector"] == reference["kv_connector"]
        assert args["kv_connector_module_path"] == reference["kv_connector_module_path"]
        assert args["kv_role"] == "kv_both"
        VLLMConnectorConfig.load(args["kv_connector_extra_config"], env={})
    # and the parser is vLLM's: a misspelt flag is refused
    with pytest.raises(AssertionError, match="kv-transfer-confg"):
        parse_vllm_args([["--model", "m", "--kv-transfer-confg", "{}"]])
