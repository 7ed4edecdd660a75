"""infra/k8s/production-stack/values.yaml against vLLM's production-stack chart (`vllm-stack`
0.1.12): it validates against the chart's own values.schema.json (vendored in
tests/deploy/data/), uses no key the chart does not know, and turns kvcloud on the way the
chart's templates read it: the connector in vLLM's arguments, its settings as variables kvcloud
reads with values the connector accepts, the Secret's keys expanded into the index URL, and
`kvcloud doctor` as the init container against the same store and index."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import yaml

from kvcloud.integrations.vllm.config import VLLMConnectorConfig
from scripts.fleet.vllm_fleet import kvcloud_transfer_config
from tests.deploy import kube

SCHEMA = kube.DATA / "production-stack" / "values.schema.json"
CHART_VERSION = "0.1.12"
# keys the chart's templates read that its schema does not list: (path, why)
TEMPLATE_ONLY = {
    ("servingEngineSpec", "modelSpec", "[]", "pdb"): "templates/pdb-vllm-multi.yaml",
    # templates/_helpers.tpl "chart.templateProbe" passes it through when set
    ("servingEngineSpec", "livenessProbe", "timeoutSeconds"): "templates/_helpers.tpl",
    ("servingEngineSpec", "readinessProbe", "timeoutSeconds"): "templates/_helpers.tpl",
}
# values the chart's templates copy verbatim (toYaml) into its manifests: Kubernetes types,
# whatever the chart's schema lists for them (its schema is generated from values.yaml, where
# most of these fields are commented out)
PASS_THROUGH = {
    ("servingEngineSpec", "securityContext"): "PodSecurityContext",
    ("servingEngineSpec", "containerSecurityContext"): "SecurityContext",
    ("servingEngineSpec", "modelSpec", "[]", "env", "[]"): "EnvVar",
    ("servingEngineSpec", "modelSpec", "[]", "extraVolumes", "[]"): "Volume",
    ("servingEngineSpec", "modelSpec", "[]", "extraVolumeMounts", "[]"): "VolumeMount",
    ("servingEngineSpec", "modelSpec", "[]", "initContainer", "env", "[]"): "EnvVar",
    ("servingEngineSpec", "modelSpec", "[]", "initContainer", "extraVolumeMounts", "[]"): (
        "VolumeMount"
    ),
    ("servingEngineSpec", "modelSpec", "[]", "initContainer", "resources"): (
        "ResourceRequirements"
    ),
}
# the chart sets no terminationGracePeriodSeconds: Kubernetes' default
DEFAULT_GRACE_SECONDS = 30


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load(kube.PRODUCTION_STACK_VALUES.read_text())


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


@pytest.fixture(scope="module")
def model(values: dict[str, Any]) -> dict[str, Any]:
    specs = values["servingEngineSpec"]["modelSpec"]
    assert len(specs) == 1
    return specs[0]


def test_values_name_the_chart_version_the_schema_is_from() -> None:
    head = kube.PRODUCTION_STACK_VALUES.read_text().split("\n\n")[0]
    assert f"chart version {CHART_VERSION}" in head
    assert f"`vllm-stack` {CHART_VERSION}" in (kube.DATA / "README.md").read_text()


def test_values_validate_against_the_charts_schema(
    values: dict[str, Any], schema: dict[str, Any]
) -> None:
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(values), key=str)
    assert not errors, f"{errors[0].message} at {list(errors[0].path)}"


def test_values_use_only_keys_the_chart_knows(
    values: dict[str, Any], schema: dict[str, Any]
) -> None:
    # The chart's schema allows unknown keys, and Helm ignores them: a misspelt key would
    # silently do nothing. Every key must be in the schema (or read by a template: listed),
    # and what the chart copies into its manifests must be valid Kubernetes.
    unknown: list[str] = []
    copied: set[tuple[str, ...]] = set()

    def walk(value: Any, node: dict[str, Any], path: tuple[str, ...]) -> None:
        if path in PASS_THROUGH:
            copied.add(path)
            unknown.extend(
                f"{'.'.join(path)}: {e}" for e in kube.validate_k8s_type(value, PASS_THROUGH[path])
            )
        elif isinstance(value, dict) and "properties" in node:
            for key, sub in value.items():
                if key in node["properties"]:
                    walk(sub, node["properties"][key], (*path, key))
                elif (*path, key) not in TEMPLATE_ONLY:
                    unknown.append(".".join((*path, key)))
        elif isinstance(value, list):
            for item in value:
                walk(item, node.get("items", {}), (*path, "[]"))

    walk(values, schema, ())
    assert not unknown, unknown
    assert copied == set(PASS_THROUGH), "a copied block is no longer where the test looks"


def test_values_turn_the_connector_on(model: dict[str, Any]) -> None:
    assert model["repository"] == "kvcloud/vllm-gpu"
    # one KV connector per vLLM: the chart's LMCache one must stay off
    assert not model.get("lmcacheConfig", {}).get("enabled", False)
    config = model["vllmConfig"]
    # the chart passes --no-enable-prefix-caching unless this is true
    assert config["enablePrefixCaching"] is True
    # the chart mounts its memory-backed /dev/shm only when tensorParallelSize is set
    assert "tensorParallelSize" in config and model["shmSize"]
    # vLLM 0 would be asked for (VLLM_USE_V1=0) if "v0" were set
    assert "v0" not in config
    argv = kube.chart_vllm_args(model)
    transfer = json.loads(kube.flag(argv, "--kv-transfer-config"))
    reference = kvcloud_transfer_config()
    for key in ("kv_connector", "kv_connector_module_path", "kv_role"):
        assert transfer[key] == reference[key], key
    assert "--enable-prompt-tokens-details" in argv
    assert float(kube.flag(argv, "--shutdown-timeout")) + 10 <= DEFAULT_GRACE_SECONDS


def test_values_environment_reaches_the_store_and_index(model: dict[str, Any]) -> None:
    # the chart puts envFromSecret's Secret on the vLLM and the init container (envFrom, which
    # the kubelet reads before env, so $(REDIS_PASSWORD) expands)
    secret = model["envFromSecret"]["name"]
    secrets = {secret: kube.documented_secrets("base")["kvcloud-secrets"]}
    known = kube.kvcloud_variables()
    init = model["initContainer"]
    assert init["image"].startswith("kvcloud/tools:")
    # the gate checks exactly what vLLM will use: its --kv-transfer-config
    assert init["command"] == [
        "kvcloud",
        "doctor",
        "--vllm-config",
        kube.flag(kube.chart_vllm_args(model), "--kv-transfer-config"),
    ]
    envs = {}
    for name, env in (("vllm", model["env"]), ("doctor", init["env"])):
        c = {"name": name, "envFrom": [{"secretRef": {"name": secret}}], "env": env}
        envs[name], unresolved = kube.environment(c, [], secrets)
        assert not unresolved, unresolved
        assert {v["name"] for v in env if v["name"].startswith("KVCLOUD_")} <= known
    for var in ("KVCLOUD_STORE", "KVCLOUD_INDEX", "KVCLOUD_SECRET", "AWS_ACCESS_KEY_ID"):
        assert envs["doctor"][var] == envs["vllm"][var], var
    settings = VLLMConnectorConfig.load(env=envs["vllm"])
    assert not settings.client_config(envs["vllm"]).insecure_secret
    password = secrets[secret]["REDIS_PASSWORD"]
    assert f":{password}@" in settings.index
