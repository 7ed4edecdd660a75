"""The Grafana dashboard queries only metrics that exist: every name in its PromQL is in a
live tiny engine's registry or in ``kvcloud stats --prometheus``; and the worker's remote
metrics (lookup/pull/push latency, bytes, failures) move when the engine does the work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcloud.tools.cli import main
from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "kvcloud-dashboard.json"
C = 16
# PromQL words that look like identifiers but are not metrics
_PROMQL_WORDS = {"sum", "by", "rate", "avg", "histogram_quantile", "clamp_min", "le"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def _names(families: object) -> set[str]:
    """Every series name a family exposes, whether or not a labelled child exists yet."""
    out: set[str] = set()
    for fam in families:  # type: ignore[attr-defined]
        out.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out


def _queried_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r"\{[^}]*\}", "", target["expr"])  # label matchers
            expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
            for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
                if word not in _PROMQL_WORDS and word.startswith("kvcloud_"):
                    names.add(word)
    return names


def _opts(tmp: Path, **kw: object) -> WorkerOptions:
    base: dict[str, object] = dict(
        model="tiny",
        cache_pages=4,
        chunk_tokens=C,
        store=f"file://{tmp / 'objects'}",
        index=f"sqlite://{tmp / 'index.db'}",
    )
    base.update(kw)
    return WorkerOptions(**base)  # type: ignore[arg-type]


def _req(tokens: list[int]) -> CompletionRequest:
    return CompletionRequest(prompt_tokens=tokens, max_tokens=2, stop_at_eos=False)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, n)]


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine, str, str]:
    tmp = tmp_path_factory.mktemp("dash")
    a = Engine(_opts(tmp))
    long = _prompt(3 * C + 5, 5)
    a.complete(_req(long))
    a.complete(_req(_prompt(3 * C, 6)))  # evicts the first prompt's pages: write-back
    assert a.uploader is not None and a.uploader.drain(10)
    b = Engine(_opts(tmp, cache_pages=16, cost_model=False))
    assert b.complete(_req(long)).tokens_remote > 0
    return a, b, f"file://{tmp / 'objects'}", f"sqlite://{tmp / 'index.db'}"


def test_dashboard_queries_only_existing_metrics(
    engines: tuple[Engine, Engine, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _a, b, store, index = engines
    available = _names(b.registry.collect())
    assert main(["stats", "--store", store, "--index", index, "--prometheus"]) == 0
    available |= _names(text_string_to_metric_families(capsys.readouterr().out))
    queried = _queried_metrics()
    assert len(queried) >= 15  # the regex found the queries at all
    missing = sorted(queried - available)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])


def test_dashboard_datasource_is_a_variable() -> None:
    """File-provisioned dashboards get no ``__inputs`` substitution, so the data source is a
    dashboard variable that defaults to Grafana's Prometheus data source."""
    dash = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dash and "${DS_" not in DASHBOARD.read_text()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    expected = {"type": "prometheus", "uid": "${datasource}"}
    for p in dash["panels"]:
        assert p["datasource"] == expected, p["title"]
        assert all(t["datasource"] == expected for t in p["targets"]), p["title"]


def test_remote_metrics_move(engines: tuple[Engine, Engine, str, str]) -> None:
    a, b, _store, _index = engines
    ra, rb = a.registry, b.registry
    assert _value(ra, "kvcloud_worker_push_seconds_count") > 0
    assert _value(ra, "kvcloud_worker_pushed_bytes_total") == _value(
        ra, "kvcloud_worker_upload_bytes_total"
    )
    assert _value(ra, "kvcloud_worker_pushed_bytes_total") > 0
    assert _value(rb, "kvcloud_worker_lookup_seconds_count") > 0
    assert _value(rb, "kvcloud_worker_pull_seconds_count") > 0
    assert _value(rb, "kvcloud_worker_pulled_bytes_total") > 0
    assert _value(rb, "kvcloud_worker_verify_failures_total") == 0


def test_verify_failure_is_counted(tmp_path: Path) -> None:
    a = Engine(_opts(tmp_path))
    long = _prompt(3 * C + 5, 7)
    a.complete(_req(long))
    a.complete(_req(_prompt(3 * C, 8)))
    assert a.uploader is not None and a.uploader.drain(10)
    objects = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    assert objects
    for path in objects:  # corrupt every stored object: pulls must fail verification
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    b = Engine(_opts(tmp_path, cache_pages=16, cost_model=False))
    r = b.complete(_req(long))
    assert r.tokens_remote == 0
    assert _value(b.registry, "kvcloud_worker_verify_failures_total") >= 1
    assert _value(b.registry, "kvcloud_worker_pull_failures_total", reason="corrupt") >= 1
