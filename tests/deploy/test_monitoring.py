"""The fleet's monitoring files agree with each other and with what the connector exports:
the plain Prometheus rules and the Kubernetes PrometheusRule are the same rules, promtool
accepts them, and every metric the rules and the vLLM fleet dashboard query is one vLLM or
the connector really exposes. (That each query returns data from real vLLM servers:
tests/vllm/test_servers.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy import kube

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "infra" / "prometheus" / "rules" / "kvcloud.rules.yml"
FLEET = ROOT / "infra" / "grafana" / "kvcloud-vllm-fleet.json"
# vLLM's own series the dashboard and rules use (vLLM 0.32's v1/metrics/loggers.py)
VLLM_OWN = {"vllm:prompt_tokens_total"}


def _metrics(expr: str) -> set[str]:
    return {
        t
        for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
        if t.startswith(("kvcloud_", "vllm:", "kvcloud:")) or t == "up"
    }


def test_the_plain_rules_and_the_prometheus_rule_are_the_same() -> None:
    plain = yaml.safe_load(RULES.read_text())
    rule = kube.named(kube.render("base"), "PrometheusRule", "kvcloud")
    assert rule["spec"] == plain
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package) checks the rules: install it"
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # ...and promtool would see a broken rule
    broken = RULES.parent.parent / "broken.rules.yml"
    try:
        broken.write_text(RULES.read_text().replace("rate(vllm:", "rate((vllm:", 1))
        r = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True)
        assert r.returncode != 0
    finally:
        broken.unlink()


def test_the_rules_and_the_fleet_dashboard_query_series_that_exist() -> None:
    plain = yaml.safe_load(RULES.read_text())
    records = {r["record"] for g in plain["groups"] for r in g["rules"] if "record" in r}
    known = (
        kube.connector_metric_names() | kube.exporter_metric_names() | VLLM_OWN | records | {"up"}
    )
    exprs = [r["expr"] for g in plain["groups"] for r in g["rules"]]
    dashboard = json.loads(FLEET.read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    for expr in exprs:
        metrics = _metrics(expr)
        assert metrics, expr
        assert metrics <= known, f"{expr}: no such metric {sorted(metrics - known)}"
    # the alerts the runbook promises
    alerts = {r["alert"] for g in plain["groups"] for r in g["rules"] if "alert" in r}
    assert {
        "KVCloudHitRateCollapsed",
        "KVCloudStoreBreakerOpen",
        "KVCloudIndexBreakerOpen",
        "KVCloudUploadsDropped",
        "KVCloudVerifyFailures",
    } <= alerts
    # every alert has a runbook entry
    runbook = (ROOT / "docs" / "OPERATIONS.md").read_text()
    missing = sorted(a for a in alerts if a not in runbook)
    assert not missing, f"docs/OPERATIONS.md has no runbook entry for {missing}"


def test_every_stack_loads_the_rules_and_the_fleet_dashboard() -> None:
    prom = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert (
        "./infra/prometheus/rules:/etc/prometheus/rules:ro"
        in (compose["services"]["prometheus"]["volumes"])
    )
    grafana = compose["services"]["grafana"]["volumes"]
    assert any(v.startswith("./infra/grafana/kvcloud-vllm-fleet.json:") for v in grafana)
    assert "infra/prometheus/rules/*.yml" in (ROOT / "infra" / "local" / "start.sh").read_text()
