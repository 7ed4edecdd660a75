"""docker-compose.yml, .env.example, infra/: Docker cannot run here, so these tests read the
files and check them against what the code reads — every variable, URL and port — and the
monitoring files (Prometheus config, Grafana provisioning) against the services they name."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvcloud.config import KVCloudConfig
from kvcloud.indexes import KNOWN_SCHEMES as INDEX_SCHEMES
from kvcloud.stores import S3Config
from kvcloud.tools.cli import build_parser
from kvcloud.urls import split_url
from workers.config import WorkerOptions

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
REDIS_CONF = ROOT / "infra" / "redis" / "redis.conf"
DOCKERFILE = ROOT / "infra" / "images" / "worker" / "Dockerfile"
LOCAL = ROOT / "infra" / "local"
PROMETHEUS_YML = ROOT / "infra" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "infra" / "grafana"

WORKERS = ("worker-1", "worker-2")
EXPORTER = "kvcloud-exporter"
# the store-scoped variables the exporter gets: what `kvcloud stats` reads, and no more
STORE_ENV = ("KVCLOUD_STORE", "KVCLOUD_INDEX", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}; $$ escapes $
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|KEY|AUTH", re.IGNORECASE)
_MAXMEMORY_POLICIES = {
    "noeviction",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
}


def _code_env_vars() -> set[str]:
    """Every environment variable kvcloud and the worker read, from their fields' metadata."""
    names: set[str] = set()
    for cls in (KVCloudConfig, WorkerOptions, S3Config):
        for f in fields(cls):
            env = f.metadata.get("env")
            if isinstance(env, str):
                names.add(env)
            elif env:
                names.update(env)
    return names


def _env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f".env.example: not NAME=value: {line!r}"
        values[name.strip()] = value.strip()
    return values


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return []


def _interpolate(value: str, env: dict[str, str]) -> str:
    """What docker compose makes of a value, given the .env file ``env``."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        have = env.get(name)
        if op in (":-", "-") and (have is None or (op == ":-" and not have)):
            return arg
        if op in (":?", "?") and (have is None or (op == ":?" and not have)):
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return have or ""

    # $$ is a literal $ that compose passes through (the container's shell expands it)
    parts = value.split("$$")
    return "$".join(_REF.sub(sub, p) for p in parts)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return _env_example()


def _service_env(service: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    raw = service.get("environment") or {}
    assert isinstance(raw, dict), "environment is written as a mapping"
    return {k: _interpolate(str(v), env) for k, v in raw.items()}


def _container_ports(service: dict[str, Any], env: dict[str, str]) -> set[int]:
    ports = set()
    for spec in service.get("ports", []):
        mapped = _interpolate(str(spec), env)
        parts = mapped.split(":")
        assert len(parts) == 3 and parts[0] == "127.0.0.1", f"{spec}: not published on loopback"
        ports.add(int(parts[2]))
    return ports


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def _option(argv: list[str], name: str) -> str:
    """The value of ``--name=value`` (the form the Prometheus image's flags use)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name}= missing from {argv}"
    return values[0]


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Container path -> (source, mode) of a service's volumes."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def _exporter_args(compose: dict[str, Any]) -> Any:
    """The exporter's command, parsed by the kvcloud CLI's own parser."""
    command = compose["services"][EXPORTER]["command"]
    assert command[:2] == ["kvcloud", "stats"], command
    return build_parser().parse_args(command[1:])


# -- services and images ----------------------------------------------------------------------


def test_services_healthchecks_and_named_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"minio", "minio-init", "redis", *WORKERS, EXPORTER, "prometheus", "grafana"} <= set(
        services
    )
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for vol in svc.get("volumes", []):
            m = re.match(r"^\$\{(\w+):-([^}]*)\}:", vol)
            if m:  # a host path the user may set in .env: its default must exist
                assert m.group(1) in _env_example(), f"{m.group(1)} missing from .env.example"
                source = m.group(2)
                assert source.startswith("."), vol
            else:
                source = vol.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"
    assert set(compose["volumes"]) == {
        "minio-data",
        "redis-data",
        "prometheus-data",
        "grafana-data",
    }
    for worker in (*WORKERS, EXPORTER):
        deps = services[worker]["depends_on"]
        assert deps["minio-init"]["condition"] == "service_completed_successfully"
        assert deps["redis"]["condition"] == "service_healthy"
        image = "tools" if worker == EXPORTER else "worker"
        assert services[worker]["build"]["dockerfile"] == f"infra/images/{image}/Dockerfile"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        image = svc.get("image")
        assert image, f"{name} names no image"
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: untagged image {image!r}"
        assert tag != "latest" and "${" not in tag, f"{name}: unpinned image {image!r}"
    assert compose["services"]["minio"]["image"].startswith("minio/minio:RELEASE.")
    assert compose["services"]["minio-init"]["image"].startswith("minio/mc:RELEASE.")
    assert compose["services"]["prometheus"]["image"].startswith("prom/prometheus:v")
    assert compose["services"]["grafana"]["image"].startswith("grafana/grafana:")
    # the exporter runs the operator tools' image (the `kvcloud` command, no PyTorch)
    assert compose["services"][EXPORTER]["image"].startswith("kvcloud/tools:")


def test_dockerfile_installs_pinned_cpu_torch_and_the_worker() -> None:
    text = DOCKERFILE.read_text()
    torch_pin = re.search(r"TORCH_PIN := (\S+)", (ROOT / "Makefile").read_text())
    assert torch_pin is not None
    assert "python:3.11" in text and "-slim" in text
    assert (
        f"pip install --no-cache-dir {torch_pin.group(1)} "
        "--index-url https://download.pytorch.org/whl/cpu" in text
    )
    # kvcloud from its own wheel, built in the first stage
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /dist ." in text
    assert "py3-none-any.whl[s3,redis,worker]" in text
    assert re.search(r'CMD \["kvcloud-worker", "serve", "--host", "0.0.0.0"', text)


# -- environment ------------------------------------------------------------------------------


def test_worker_env_is_what_the_code_reads(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    known = _code_env_vars()
    ids = set()
    for worker in WORKERS:
        env = _service_env(compose["services"][worker], env_example)
        unknown = sorted(k for k in env if k.startswith("KVCLOUD_") and k not in known)
        assert not unknown, f"{worker} sets variables no code reads: {unknown}"
        for required in ("KVCLOUD_STORE", "KVCLOUD_INDEX", "KVCLOUD_SECRET", "KVCLOUD_WORKER_ID"):
            assert env.get(required), f"{worker} does not set {required}"
        assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
        # the values configure a worker and a client without complaint
        opts = WorkerOptions.from_env(env)
        assert opts.store == env["KVCLOUD_STORE"] and opts.worker_id == worker
        assert opts.model == env_example["KVCLOUD_WORKER_MODEL"]
        assert opts.cache_pages == int(env_example["KVCLOUD_CACHE_PAGES"])
        cfg = KVCloudConfig.from_env(env)
        assert not cfg.insecure_secret
        ids.add(opts.worker_id)
    assert len(ids) == len(WORKERS)


def test_urls_parse_and_point_at_the_services(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    env = _service_env(services["worker-1"], env_example)

    s3 = S3Config.from_url(env["KVCLOUD_STORE"], env={})
    assert s3.bucket == env_example["KVCLOUD_BUCKET"]
    assert s3.region == env_example["KVCLOUD_S3_REGION"]
    endpoint = urlsplit(s3.endpoint_url or "")
    assert endpoint.hostname == "minio"
    minio_port = int(_flag(services["minio"]["command"], "--address").lstrip(":"))
    assert endpoint.port == minio_port
    assert minio_port in _container_ports(services["minio"], env_example)
    init_env = _service_env(services["minio-init"], env_example)
    assert urlsplit(init_env["MINIO_ENDPOINT"]).port == minio_port
    assert init_env["KVCLOUD_BUCKET"] == s3.bucket

    scheme, _netloc, _path, _query = split_url(env["KVCLOUD_INDEX"])
    assert scheme in INDEX_SCHEMES
    index = urlsplit(env["KVCLOUD_INDEX"])
    assert index.hostname == "redis"
    assert index.password == env_example["REDIS_PASSWORD"]
    assert index.port == _redis_conf_port()
    # the worker's S3 user is the one minio-init creates
    assert env["AWS_ACCESS_KEY_ID"] == init_env["KVCLOUD_S3_ACCESS_KEY"]
    assert env["AWS_SECRET_ACCESS_KEY"] == init_env["KVCLOUD_S3_SECRET_KEY"]


def _redis_conf_port() -> int:
    m = re.search(r"^port (\d+)$", REDIS_CONF.read_text(), re.MULTILINE)
    assert m is not None
    return int(m.group(1))


def test_ports_match_what_services_listen_on(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    for worker in WORKERS:
        svc = services[worker]
        port = int(_flag(svc["command"], "--port"))
        assert _flag(svc["command"], "--host") == "0.0.0.0"
        assert svc["command"][:2] == ["kvcloud-worker", "serve"]
        health = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/healthz" in health
        assert _container_ports(svc, env_example) == {port}
        assert f"EXPOSE {port}" in DOCKERFILE.read_text()
    host_ports = [
        int(_interpolate(str(spec), env_example).split(":")[1])
        for svc in services.values()
        for spec in svc.get("ports", [])
    ]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"

    minio = services["minio"]
    console = int(_flag(minio["command"], "--console-address").lstrip(":"))
    assert _container_ports(minio, env_example) == {9000, console}

    redis_port = _redis_conf_port()
    redis = services["redis"]
    assert _container_ports(redis, env_example) == {redis_port}
    assert "--port" not in " ".join(redis["command"])
    assert _flag(redis["healthcheck"]["test"], "-p") == str(redis_port)


# -- monitoring: exporter, Prometheus, Grafana ------------------------------------------------


def test_exporter_gets_the_workers_store_and_nothing_more(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    exporter = services[EXPORTER]
    env = _service_env(exporter, env_example)
    worker_env = _service_env(services["worker-1"], env_example)
    assert sorted(env) == sorted(STORE_ENV)
    assert all(env[k] == worker_env[k] for k in STORE_ENV)
    cfg = KVCloudConfig.from_env(env)  # a valid store and index URL for kvcloud
    assert cfg.store == env["KVCLOUD_STORE"] and cfg.index == env["KVCLOUD_INDEX"]

    args = _exporter_args(compose)
    host, _, port = args.serve.rpartition(":")
    assert host == "0.0.0.0", "the exporter must listen beyond the container's loopback"
    assert args.interval >= 30, "each scan lists the whole index and bucket"
    health = " ".join(exporter["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/metrics" in health
    assert not exporter.get("ports"), "Prometheus reaches the exporter on the compose network"
    deps = exporter["depends_on"]
    assert deps["minio-init"]["condition"] == "service_completed_successfully"
    assert deps["redis"]["condition"] == "service_healthy"


def test_prometheus_scrapes_the_workers_and_the_exporter(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    prom = services["prometheus"]
    command = prom["command"]
    mounts = _mounts(prom)
    source, mode = mounts[_option(command, "--config.file")]
    assert (ROOT / source).resolve() == PROMETHEUS_YML and mode == "ro"
    assert mounts[_option(command, "--storage.tsdb.path")][0] == "prometheus-data"
    port = int(_option(command, "--web.listen-address").rpartition(":")[2])
    assert _container_ports(prom, env_example) == {port}
    assert f"http://127.0.0.1:{port}/-/ready" in prom["healthcheck"]["test"]

    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvcloud-worker", "kvcloud-stats", "vllm"}

    def targets(job: dict[str, Any]) -> set[str]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        return {t for group in job["static_configs"] for t in group["targets"]}

    worker_targets = {f"{w}:{_flag(services[w]['command'], '--port')}" for w in WORKERS}
    assert targets(jobs["kvcloud-worker"]) == worker_targets
    exporter_port = _exporter_args(compose).serve.rpartition(":")[2]
    assert targets(jobs["kvcloud-stats"]) == {f"{EXPORTER}:{exporter_port}"}
    # scraping the exporter faster than it rescans only repeats the same figures
    assert int(jobs["kvcloud-stats"]["scrape_interval"].rstrip("s")) >= 30
    # every vLLM service of the gpu and cpu profiles, on the port its command serves
    vllm = {n for n, s in services.items() if n.startswith("vllm-")}
    assert vllm and all("--port" in services[n]["command"] for n in vllm)
    assert targets(jobs["vllm"]) == {f"{n}:{_flag(services[n]['command'], '--port')}" for n in vllm}

    promtool = shutil.which("promtool")
    if promtool:
        subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], check=True)


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    services = compose["services"]
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    source, mode = mounts["/etc/grafana/provisioning"]
    assert (ROOT / source).resolve() == GRAFANA / "provisioning" and mode == "ro"
    assert mounts["/var/lib/grafana"][0] == "grafana-data"
    assert _container_ports(grafana, env_example) == {3000}
    assert "http://127.0.0.1:3000/api/health" in grafana["healthcheck"]["test"]
    env = grafana["environment"]
    m = _REF.fullmatch(env["GF_SECURITY_ADMIN_PASSWORD"])
    assert m and m.group(2) == ":?", "the admin password comes from .env, with no default"

    provisioning = GRAFANA / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (datasource,) = sources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["uid"] and datasource["isDefault"]
    url = urlsplit(datasource["url"])
    prom_port = int(_option(services["prometheus"]["command"], "--web.listen-address")[1:])
    assert (url.hostname, url.port) == ("prometheus", prom_port)

    providers = yaml.safe_load((provisioning / "dashboards" / "kvcloud.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    dashboards = {
        target: src
        for target, (src, _mode) in mounts.items()
        if target.startswith(provider["options"]["path"].rstrip("/") + "/")
    }
    assert sorted((ROOT / src).resolve() for src in dashboards.values()) == [
        GRAFANA / "kvcloud-dashboard.json",
        GRAFANA / "kvcloud-vllm-fleet.json",
    ]
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards


# -- secrets ----------------------------------------------------------------------------------


def test_no_secret_is_hard_coded(compose: dict[str, Any], env_example: dict[str, str]) -> None:
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if _SECRET_NAME.search(key):
                assert _REF.fullmatch(str(value)), f"{name}.{key} is not a ${{VAR}} reference"
    text = COMPOSE.read_text()
    for key, value in env_example.items():
        if _SECRET_NAME.search(key) and value and not key.endswith("ACCESS_KEY"):
            assert value not in text, f"the value of {key} appears in docker-compose.yml"
    # the only credential inside a URL is a reference
    for s in _strings(compose):
        for m in re.finditer(r"://([^/@\s]*)@", s):
            assert _REF.fullmatch(m.group(1).lstrip(":")), f"credentials in a URL: {s!r}"
    for word in ("minioadmin", "testing"):
        assert word not in text


def test_env_example_defines_every_variable_and_holds_only_placeholders(
    compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    used = {m.group(1) for s in _strings(compose) for m in _REF.finditer(s.replace("$$", ""))}
    missing = sorted(used - set(env_example))
    assert not missing, f"used in docker-compose.yml but not in .env.example: {missing}"
    unused = sorted(set(env_example) - used)
    assert not unused, f".env.example defines variables compose does not use: {unused}"
    for key, value in env_example.items():
        if _SECRET_NAME.search(key) and not key.endswith("ACCESS_KEY"):  # an id, not a secret
            assert value == "" or value.startswith("change-me"), f"{key}: not a placeholder"
    # every ${VAR} resolves with the example file (required ones included)
    for s in _strings(compose):
        _interpolate(s, env_example)


# -- redis.conf, minio init, local scripts ----------------------------------------------------


def test_redis_conf_persists_and_names_an_eviction_policy() -> None:
    conf = {}
    for line in REDIS_CONF.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            conf[key] = value.strip()
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] in ("everysec", "always")
    assert conf["maxmemory-policy"] in _MAXMEMORY_POLICIES
    text = REDIS_CONF.read_text()
    assert "noeviction" in text and "volatile-lru" in text  # the trade-off is written down


def test_minio_init_creates_bucket_and_abort_rule(compose: dict[str, Any]) -> None:
    init = compose["services"]["minio-init"]
    script = ROOT / init["volumes"][0].split(":")[0]
    text = script.read_text()
    assert init["entrypoint"] == ["/bin/sh", "/init.sh"]
    assert "mc mb --ignore-existing" in text
    assert '"AbortIncompleteMultipartUpload": {"DaysAfterInitiation"' in text
    assert "mc ilm rule import" in text


@pytest.mark.parametrize("name", ["start.sh", "stop.sh"])
def test_local_scripts_are_strict_bash(name: str) -> None:
    script = LOCAL / name
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)
    if name == "start.sh":
        assert "infra/redis/redis.conf" in text and '/bin/weed" server' in text
        assert '"${KVCLOUD_WORKER_MODEL:-small}"' in text
        assert '"$VENV/bin/kvcloud" stats --serve' in text
        assert "file_sd_configs" in text and "$STATE/prometheus/targets/*.json" in text
