"""Worker processes for end-to-end tests: `kvcloud-worker serve` on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import MotoServer, free_port

CHUNK = 16


class WorkerProc:
    def __init__(
        self,
        name: str,
        log_dir: Path,
        store: str | None,
        index: str | None,
        cache_pages: int = 64,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.argv = [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(self.port),
            "--worker-id",
            name,
            "--chunk-tokens",
            str(CHUNK),
            "--cache-pages",
            str(cache_pages),
            "--threads",
            "1",
            "--store",
            store or "none",
            *(["--index", index] if index else []),
            *(extra or []),
        ]
        self.env = {**os.environ, "KVCLOUD_SECRET": "e2e-secret", **(env or {})}
        self.log_path = log_dir / f"worker-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        self.start()

    def start(self) -> WorkerProc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if self.client.get("/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready:\n{self.log_path.read_text()[-3000:]}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.client.post(path, json=body or {})

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def servers_urls(moto_server: MotoServer, redis_url: str) -> tuple[str, str]:
    prefix = f"e2e-{uuid.uuid4().hex[:10]}"
    store = (
        f"s3://kvcloud/{prefix}?endpoint_url={moto_server.endpoint}&region=us-east-1"
        "&create_bucket=true"
    )
    return store, redis_url


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProc] = []

    def _spawn(
        name: str, store: str | None = None, index: str | None = None, **kw: Any
    ) -> WorkerProc:
        w = WorkerProc(name, tmp_path, store, index, **kw)
        started.append(w)
        return w

    yield _spawn
    for w in started:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
        w.client.close()
