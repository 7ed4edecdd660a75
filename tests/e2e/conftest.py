"""Worker processes for end-to-end tests: `kvcloud-worker serve` on free ports."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ceph import CephRGW
from tests.servers import WorkerProcess, free_port

CHUNK = 16


class WorkerProc(WorkerProcess):
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
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
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
        super().__init__(
            name,
            argv,
            {**os.environ, "KVCLOUD_SECRET": "e2e-secret", **(env or {})},
            log_dir / f"worker-{name}.log",
            port,
            f"http://127.0.0.1:{port}",
        )
        self.start()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def servers_urls(ceph_rgw: CephRGW, redis_url: str) -> tuple[str, str]:
    """Ceph's S3 gateway and redis-server: production servers."""
    return ceph_rgw.store_url("kvcloud", f"e2e-{uuid.uuid4().hex[:10]}"), redis_url


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
