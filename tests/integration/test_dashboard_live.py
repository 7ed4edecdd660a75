"""The Grafana dashboard moves while the demo runs, evaluated by a real Prometheus.

A ``prometheus`` process scrapes the demo's workers (found through the ``file_sd`` file the
demo keeps with ``--prometheus-sd``) and a ``kvcloud stats --serve`` exporter every second.
After the demo, every PromQL expression of ``infra/grafana/kvcloud-dashboard.json`` is
evaluated over the demo's time range through Prometheus's HTTP API, exactly as Grafana would
send it. Every panel must return data, the ones that measure the demo's work must rise above
zero, and the failure panels must stay at zero (the demo restores clean objects).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from kvcloud.indexes import SQLiteIndex
from tests.prometheus import Prometheus, get_json
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "kvcloud-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
KVCLOUD = [sys.executable, "-m", "kvcloud.tools.cli"]
# a small conversation on the tiny model; each worker waits 3 s (3 scrapes) after it
# starts and before it stops, so Prometheus sees its counters before and after the work
DEMO = [sys.executable, "-m", "workers.demo", "--model", "tiny", "--chars", "700"]
DEMO += ["--max-tokens", "4", "--scrape-wait", "3"]

# Panels (by their exact expression's leading metric and labels) that the demo must move.
MUST_RISE = [
    'kvcloud_worker_prompt_tokens_total{source="remote"}',
    'kvcloud_worker_prompt_tokens_total{source="computed"}',
    "kvcloud_worker_ttft_seconds_bucket",
    "kvcloud_worker_requests_total",
    "kvcloud_worker_pushed_bytes_total",
    "kvcloud_worker_pulled_bytes_total",
    "kvcloud_worker_lookup_seconds_bucket",
    "kvcloud_worker_pull_seconds_bucket",
    "kvcloud_worker_push_seconds_bucket",
    "kvcloud_worker_cache_pages",
    "sum(kvcloud_index_entries)",
    "kvcloud_store_objects",
    "kvcloud_index_sessions",
    "kvcloud_store_bytes",
    "sum(kvcloud_index_entry_bytes)",
]
# ...and the ones that must stay at zero: nothing is corrupt or missing in the demo.
MUST_STAY_ZERO = [
    "kvcloud_worker_verify_failures_total",
    "kvcloud_worker_pull_failures_total",
    "kvcloud_worker_remote_fallbacks_total",
]

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"),
    reason="prometheus not installed (apt-get install prometheus; .ci/run installs it)",
)


def _targets() -> list[tuple[str, str]]:
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_every_dashboard_panel_has_data_and_moves_during_the_demo(tmp_path: Path) -> None:
    assert PROMETHEUS, "CI must have prometheus (see .ci/run)"
    store = f"file://{tmp_path / 'objects'}"
    index = f"sqlite://{tmp_path / 'index.db'}"
    sd_dir = tmp_path / "targets"
    sd_dir.mkdir()
    env = {**os.environ, "KVCLOUD_STORE": store, "KVCLOUD_INDEX": index}
    env.pop("KVCLOUD_SECRET", None)
    # the exporter reads an existing store and index and never creates them: create them
    # empty, as a deployment's first worker would, so its figures start at 0
    (tmp_path / "objects").mkdir()
    SQLiteIndex(tmp_path / "index.db").close()

    exporter_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "kvcloud-worker",
                        "file_sd_configs": [
                            {"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}
                        ],
                    },
                    {
                        "job_name": "kvcloud-stats",
                        "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
                    },
                ],
            }
        )
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def spawn(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        procs.append(p)
        return p

    try:
        spawn(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
        )
        spawn(
            "exporter",
            [*KVCLOUD, "stats", "--serve", str(exporter_port), "--interval", "0.5"],
        )
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        Prometheus.wait(
            lambda: any(
                t["health"] == "up"
                for t in get_json(f"{api}/targets")["data"]["activeTargets"]
                if t["labels"]["job"] == "kvcloud-stats"
            ),
            "Prometheus to scrape the exporter",
        )
        start = time.time()
        demo = subprocess.run(
            [*DEMO, "--dir", str(tmp_path / "demo"), "--prometheus-sd", str(sd_dir / "demo.json")],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        assert not (sd_dir / "demo.json").exists(), "the demo leaves no stale targets behind"
        time.sleep(2)  # the exporter's and Prometheus's last looks at the final figures
        end = time.time()

        failures = []
        for title, expr in _targets():
            q = expr.replace("$__rate_interval", "5s")
            params = urllib.parse.urlencode(
                {"query": q, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
            )
            body = get_json(f"{api}/query_range?{params}")
            assert body["status"] == "success", (title, expr, body)
            values = [
                float(v)
                for series in body["data"]["result"]
                for _, v in series["values"]
                if not math.isnan(float(v))
            ]
            if not values:
                failures.append(f"{title}: {expr} returned no data")
                continue
            if any(key in expr for key in MUST_STAY_ZERO) and max(values) != 0:
                failures.append(f"{title}: {expr} rose to {max(values)}")
            if any(key in expr for key in MUST_RISE) and max(values) <= 0:
                failures.append(f"{title}: {expr} never rose above 0")
        assert not failures, "\n".join(failures)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
