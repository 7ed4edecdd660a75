"""A real ``prometheus`` process for the dashboard and alert tests: scrapes the given targets
every second, evaluates the given rule files every second, and answers PromQL over its HTTP
API exactly as Grafana and Alertmanager would ask."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.servers import free_port

PROMETHEUS = shutil.which("prometheus")


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@dataclass
class Prometheus:
    folder: Path
    jobs: dict[str, list[str]]  # job name -> host:port targets
    rule_files: list[Path] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    def start(self) -> Prometheus:
        assert PROMETHEUS, "prometheus is not installed (scripts/system-deps.sh installs it)"
        self.port = self.port or free_port()
        config = self.folder / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in self.rule_files],
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": targets}]}
                        for job, targets in self.jobs.items()
                    ],
                }
            )
        )
        with open(self.folder / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.folder / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait(self._all_up, "Prometheus to scrape every target")
        return self

    def _all_up(self) -> bool:
        targets = get_json(f"{self.api}/targets")["data"]["activeTargets"]
        wanted = sum(len(t) for t in self.jobs.values())
        return sum(t["health"] == "up" for t in targets) >= wanted

    @staticmethod
    def wait(pred: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if pred():
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def query_range(self, expr: str, start: float, end: float, step: float = 1) -> list[dict]:
        params = urllib.parse.urlencode(
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
        )
        body = get_json(f"{self.api}/query_range?{params}")
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def query(self, expr: str) -> list[dict]:
        body = get_json(f"{self.api}/query?{urllib.parse.urlencode({'query': expr})}")
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def rules(self) -> list[dict]:
        return [r for g in get_json(f"{self.api}/rules")["data"]["groups"] for r in g["rules"]]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def finite_values(result: list[dict]) -> list[float]:
    """Every sample of a range query's series that is a number (histogram_quantile over no
    observations is NaN: no data)."""
    return [
        float(v)
        for series in result
        for _, v in series["values"]
        if not math.isnan(float(v)) and not math.isinf(float(v))
    ]
