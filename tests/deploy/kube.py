"""Helpers for tests/deploy/test_k8s.py: render infra/k8s with `kubectl kustomize`, walk the
pod specs, resolve a container's environment the way the kubelet does, read the names kvcloud
and its metrics really use, and evaluate cron schedules. No cluster: rendering is local."""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
TARGETS = {
    "base": K8S / "base",
    "dev": K8S / "overlays" / "dev",
    "prod": K8S / "overlays" / "prod",
}
OVERLAYS = ("dev", "prod")
PRODUCTION_STACK_VALUES = K8S / "production-stack" / "values.yaml"
DATA = Path(__file__).resolve().parent / "data"

# kinds with a pod template, and where it sits
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")
# what the vLLM workload and its containers are called in every render
VLLM_DEPLOYMENT, VLLM_CONTAINER, DOCTOR_CONTAINER = "kvcloud-vllm", "vllm", "kvcloud-doctor"

Doc = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed: tests/deploy/test_k8s.py renders infra/k8s with "
            "`kubectl kustomize` (kustomize is built into kubectl; no cluster is needed)",
            pytrace=False,
        )
    return path


@functools.cache
def _render_text(directory: Path) -> str:
    r = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{r.stderr}")
    return r.stdout


def render(target: str) -> list[Doc]:
    """The manifests of one kustomization (a fresh copy: tests may not share mutations)."""
    return [d for d in yaml.safe_load_all(_render_text(TARGETS[target])) if d]


def render_text(target: str) -> str:
    return _render_text(TARGETS[target])


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def pod_template(doc: Doc) -> Doc:
    """A workload's pod template (metadata and spec)."""
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]
    return doc["spec"]["template"]


def workloads(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, its pod spec) for every object that runs pods."""
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, pod_template(d)["spec"]


def containers(pod_spec: Doc) -> list[Doc]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def container(pod_spec: Doc, name: str) -> Doc:
    found = [c for c in containers(pod_spec) if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}"
    return found[0]


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# -- Secrets: documented, never committed -------------------------------------------------


def documented_secrets(target: str) -> dict[str, dict[str, str]]:
    """The Secrets a render reads, from its directory's secrets.example.yaml (name -> key ->
    a stand-in value: hex, as the examples ask, so it fits in a URL unescaped)."""
    path = TARGETS[target] / "secrets.example.yaml"
    out: dict[str, dict[str, str]] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["kind"] == "Secret", path
        keys = {**doc.get("stringData", {}), **doc.get("data", {})}
        out[doc["metadata"]["name"]] = {k: stand_in(k) for k in keys}
    return out


def stand_in(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


# -- environment, as the kubelet builds it -------------------------------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, defined: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined name is replaced, an undefined one is left as
    written, $$ is a literal $."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return defined[name] if name in defined else m.group(0)

    return _REF.sub(one, text)


def undefined_refs(text: str, defined: Mapping[str, str]) -> list[str]:
    return [m.group(1) for m in _REF.finditer(text) if m.group(1) and m.group(1) not in defined]


def environment(
    c: Doc, docs: list[Doc], secrets: Mapping[str, Mapping[str, str]]
) -> tuple[dict[str, str], list[str]]:
    """(the container's final variables, the $(VAR) references that would stay unexpanded).
    envFrom first, then env in order, each value expanded against what came before it:
    the kubelet's order (pkg/kubelet/kubelet_pods.go, makeEnvironmentVariables)."""
    env: dict[str, str] = {}
    unresolved: list[str] = []
    for source in c.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = named(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {})
        else:
            name = source["secretRef"]["name"]
            assert name in secrets, f"{c['name']}: envFrom Secret {name} is not documented"
            data = dict(secrets[name])
        env.update({prefix + k: v for k, v in data.items()})
    for var in c.get("env", []):
        if "value" in var:
            unresolved += [f"{var['name']}: $({r})" for r in undefined_refs(var["value"], env)]
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            cm = named(docs, "ConfigMap", ref["configMapKeyRef"]["name"]).get("data", {})
            env[var["name"]] = cm[ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            sk = ref["secretKeyRef"]
            assert sk["key"] in secrets.get(sk["name"], {}), (
                f"{c['name']}: {var['name']} reads Secret {sk['name']} key {sk['key']}, "
                "which secrets.example.yaml does not document"
            )
            env[var["name"]] = secrets[sk["name"]][sk["key"]]
        else:  # fieldRef, resourceFieldRef: known only in a running pod
            env[var["name"]] = f"<{var['name']}>"
    for arg in [*c.get("command", []), *c.get("args", [])]:
        unresolved += [f"argument {arg!r}: $({r})" for r in undefined_refs(arg, env)]
    return env, unresolved


def arguments(c: Doc, env: Mapping[str, str]) -> list[str]:
    """The container's args as the process gets them."""
    return [expand(a, env) for a in c.get("args", [])]


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` (or of ``name=value``) in an argument list."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} is not in {argv}")


# -- what kvcloud reads, what it exports ----------------------------------------------------


def _python_files() -> Iterator[Path]:
    for package in ("kvcloud", "workers"):
        yield from sorted((ROOT / package).rglob("*.py"))


@functools.cache
def kvcloud_variables() -> frozenset[str]:
    """Every environment variable kvcloud (or its worker) reads: the names in dataclass field
    metadata (``metadata={"env": NAME}`` or a tuple of names) and the literal names passed to
    ``os.environ[...]``, ``os.environ.get``, ``os.getenv`` and the like. Read from the source
    (no import: the vLLM connector's modules import vLLM)."""
    names: set[str] = set()
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "env":
                        names.update(_strings(value))
            elif isinstance(node, ast.Call) and node.args:
                func = ast.unparse(node.func)
                if "environ" in func or "getenv" in func:
                    names.update(_strings(node.args[0]))
            elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
                names.update(_strings(node.slice))
    return frozenset(names)


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def connector_metric_names() -> frozenset[str]:
    """The names the connector exports on vLLM's /metrics (kvcloud/integrations/vllm/
    metadata.py: ``vllm:kvcloud_<name>`` counters, histograms and gauges, read from its
    tables; importing it needs vLLM)."""
    path = ROOT / "kvcloud" / "integrations" / "vllm" / "metadata.py"
    source = path.read_text()
    # the prefix the tables' names get when registered; a change there must show here
    assert source.count('name=f"vllm:kvcloud_{name}"') == 3, "metric naming in metadata.py"
    tables: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(node.value, ast.Dict)
        ):
            tables[node.target.id] = [k.value for k in node.value.keys if k is not None]
    names = {f"vllm:kvcloud_{n}_total" for n in tables["COUNTERS"]}
    names |= {f"vllm:kvcloud_{n}" for n in tables["GAUGES"]}
    names |= {f"vllm:kvcloud_{n}_{s}" for n in tables["HISTOGRAMS"] for s in ("bucket", "sum")}
    names |= {f"vllm:kvcloud_{n}_count" for n in tables["HISTOGRAMS"]}
    assert 'name="vllm:kvcloud_info"' in source
    names.add("vllm:kvcloud_info")
    return frozenset(names)


def exporter_metric_names() -> frozenset[str]:
    """The sample names `kvcloud stats --serve` really exposes, from one scan of a fake
    result through the exporter's own registry."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvcloud.tools.exporter import StatsExporter

    result = {
        "namespaces": {"ns": {"entries": 1, "bytes": 2, "tokens": 3}},
        "sessions": 1,
        "counters": {"pushes": 1},
        "objects": 1,
        "object_bytes": 2,
        "collected_at": 0.0,
    }
    exporter = StatsExporter(lambda: result, interval=60)
    assert exporter.scan_once()
    text = generate_latest(exporter.registry).decode()
    return frozenset(
        s.name for family in text_string_to_metric_families(text) for s in family.samples
    )


# -- cron ----------------------------------------------------------------------------------

_MACROS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *"}
_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))


def _field(text: str, low: int, high: int) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        base, _, step = part.partition("/")
        if base == "*":
            start, end = low, high
        elif "-" in base:
            a, b = base.split("-")
            start, end = int(a), int(b)
        else:
            start = end = int(base)
            if step:
                end = high
        values.update(range(start, end + 1, int(step or 1)))
    # day of week 7 is Sunday, as 0 is
    return {0 if (v == 7 and high == 6) else v for v in values}


def cron_gaps(schedule: str, days: int = 35) -> tuple[timedelta, timedelta]:
    """(shortest, longest) time between two runs of a standard 5-field cron schedule, over
    ``days`` days (minute by minute: enough for the schedules a CronJob takes)."""
    fields = _MACROS.get(schedule, schedule).split()
    assert len(fields) == 5, f"not a 5-field cron schedule: {schedule!r}"
    minute, hour, dom, month, dow = (
        _field(f, lo, hi) for f, (lo, hi) in zip(fields, _RANGES, strict=True)
    )
    # cron's rule: when both day fields are restricted, either one matching is enough
    either = fields[2] != "*" and fields[4] != "*"
    t, end = datetime(2026, 1, 1), datetime(2026, 1, 1) + timedelta(days=days)
    runs: list[datetime] = []
    while t < end:
        day_ok = (
            (t.day in dom or (t.isoweekday() % 7) in dow)
            if either
            else (t.day in dom and (t.isoweekday() % 7) in dow)
        )
        if t.minute in minute and t.hour in hour and t.month in month and day_ok:
            runs.append(t)
        t += timedelta(minutes=1)
    assert len(runs) >= 2, f"{schedule!r} runs less than twice in {days} days"
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    return min(gaps), max(gaps)


# -- custom resources and checkov ------------------------------------------------------------

CRD_FILES = {
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


@functools.cache
def crd_schema(kind: str, api_version: str) -> Doc:
    """The vendored CRD's OpenAPI schema for ``kind`` at ``api_version``, made strict: an
    object that lists its properties takes no others (what `kubectl apply`'s server-side
    field validation refuses, where the API server would otherwise drop a misspelt field)."""
    crd = yaml.safe_load((DATA / "prometheus-operator" / CRD_FILES[kind]).read_text())
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group, api_version
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    _strict(schema)
    return schema


def _strict(node: Any) -> None:
    if isinstance(node, dict):
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


CHECKOV = ROOT / ".venv-deploy" / "bin" / "checkov"


def run_checkov(docs_text: str, workdir: Path) -> Doc:
    """checkov's Kubernetes checks on one rendered overlay (its JSON report)."""
    import json

    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run `make install-deploy` (make test does)")
    (workdir / "manifests").mkdir()
    (workdir / "manifests" / "all.yaml").write_text(docs_text)
    r = subprocess.run(
        [
            str(CHECKOV),
            "--framework",
            "kubernetes",
            "--directory",
            str(workdir / "manifests"),
            "--output",
            "json",
            # offline: no guideline download, no platform mapping
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(workdir), "BC_SKIP_MAPPING": "TRUE"},
    )
    # exit 1 means failed checks, which the test reports; anything else is checkov failing
    assert r.returncode in (0, 1), f"checkov failed ({r.returncode}):\n{r.stderr[-3000:]}"
    report = json.loads(r.stdout)
    if isinstance(report, list):
        (report,) = [x for x in report if x.get("check_type") == "kubernetes"]
    return report


def chart_vllm_args(spec: dict[str, Any]) -> list[str]:
    """The arguments the chart's templates/deployment-vllm-multi.yaml (0.1.12) gives vLLM for
    the keys our values set (it runs `vllm serve <modelURL>` with them)."""
    config = spec["vllmConfig"]
    argv = ["--model", spec["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
    argv.append(
        "--enable-prefix-caching" if config["enablePrefixCaching"] else "--no-enable-prefix-caching"
    )
    for key, name in (
        ("maxModelLen", "--max-model-len"),
        ("tensorParallelSize", "--tensor-parallel-size"),
        ("gpuMemoryUtilization", "--gpu_memory_utilization"),
    ):
        if key in config:
            argv += [name, str(config[key])]
    return argv + config.get("extraArgs", [])


def validate_k8s_type(value: Any, type_name: str) -> list[str]:
    """Errors of ``value`` as the Kubernetes type ``type_name`` (``SecurityContext``,
    ``EnvVar``, ...: core/v1), with kubernetes-validate's strict schemas of its newest
    version: for values a chart copies verbatim into its manifests."""
    import jsonschema
    from kubernetes_validate.utils import latest_version, schema_contents
    from referencing import Registry, Resource

    directory = f"kubernetes-json-schema/v{latest_version()}-local-strict"
    schema = schema_contents(f"{directory}/{type_name.lower()}-v1.json", latest_version())
    definitions = schema_contents(f"{directory}/_definitions.json", latest_version())
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{e.message} at {list(e.path)}" for e in validator.iter_errors(value)]
