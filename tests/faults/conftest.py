"""Fault-injection harness: worker processes, a reference worker, metrics, verification.

Every scenario runs real processes (``kvcloud-worker serve``, ``redis-server``, an S3
server) and does to them what production does: SIGKILL, SIGSTOP, restarts, cut links,
objects changed behind the workers' backs. The S3 server is Ceph RGW (the ``s3_server``
fixture), and where an invariant depends on conditional writes also Swift s3api and
rclone; ``moto_server`` stays where the scenario is about the process itself (paused and
restarted empty in test_store_outage.py, moved into a network namespace in
test_multihost.py). Workers here are plain subprocesses like
tests/e2e's, plus what fault tests need: a bind address and network namespace, a timed
request, and /metrics parsed into numbers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.faults import report
from tests.servers import WorkerProcess, free_port, netns_prefix

CHUNK = 16
SECRET = "faults-secret"
# Every request of every scenario must be answered within this (the workers' remote timeout
# is 1 s; a request waits for at most a few remote calls before it recomputes).
REQUEST_BOUND_S = 15.0
GEN = {"temperature": 0, "return_token_ids": True, "ignore_eos": True}


# the reliability log: each test's observation and outcome (see report.py)
pytest_runtest_makereport = report.pytest_runtest_makereport
reliability = report.reliability


# -- prompts -----------------------------------------------------------------------------------


def text(n: int, seed: int) -> str:
    """n lowercase letters: n + 1 tokens with the BOS a text prompt opens with."""
    rng = np.random.default_rng(seed)
    return "".join(chr(c) for c in rng.integers(97, 123, n))


def body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, **GEN, **extra}


def wait_for(cond: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# -- worker processes --------------------------------------------------------------------------


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def parse_metrics(text_: str) -> dict[str, float]:
    """Prometheus text exposition → {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text_.splitlines():
        if line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line.strip())
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                continue
    return out


class Worker(WorkerProcess):
    """``kvcloud-worker serve`` (tiny preset, chunk 16) as a subprocess.

    ``netns`` runs it inside a network namespace, listening on ``host`` (0.0.0.0 there);
    ``connect`` is the address the test process reaches it at.
    """

    def __init__(
        self,
        name: str,
        log_dir: Path,
        store: str | None,
        index: str | None,
        *,
        cache_pages: int = 64,
        write_policy: str = "write-back",
        remote_timeout: float = 1.0,
        cost_model: bool = False,
        upload_queue: int = 64,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        connect: str = "127.0.0.1",
        start: bool = True,
    ) -> None:
        # a fresh network namespace has every port free; the number just has to be known
        port = free_port()
        argv = [
            *netns_prefix(netns),
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--model",
            "tiny",
            "--host",
            host,
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
            "--write-policy",
            write_policy,
            "--upload-queue",
            str(upload_queue),
            "--remote-timeout",
            str(remote_timeout),
            "--store",
            store or "none",
            "--no-access-log",
            *(["--index", index] if index else []),
            *(extra or []),
        ]
        super().__init__(
            name,
            argv,
            {
                **os.environ,
                "KVCLOUD_SECRET": SECRET,
                "KVCLOUD_COST_MODEL": "true" if cost_model else "false",
                **(env or {}),
            },
            log_dir / f"worker-{name}.log",
            port,
            f"http://{connect}:{port}",
        )
        if start:
            self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def complete(self, payload: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """A completion; the reply gains ``_elapsed`` (seconds, as the client saw it)."""
        t0 = time.monotonic()
        r = self.client.post("/v1/completions", json=payload, timeout=timeout)
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, f"{self.name}: {r.status_code} {r.text[:500]}"
        out = r.json()
        out["_elapsed"] = elapsed
        return out

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.client.get("/metrics", timeout=10).text)

    def health(self) -> dict[str, Any]:
        return self.client.get("/healthz", timeout=10).json()

    def uploads(self, result: str) -> float:
        return self.metrics().get(f'kvcloud_worker_uploads_total{{result="{result}"}}', 0.0)

    def drain(self, timeout: float = 30.0, quiet: int = 3) -> bool:
        """Wait until nothing is queued for upload and the upload counters have not moved
        for ``quiet`` polls in a row (0.2 s apart): the queue gauge does not count the page
        being uploaded, the counters do once it is done."""
        last: tuple[float, ...] | None = None
        still = 0

        def settled() -> bool:
            nonlocal last, still
            m = self.metrics()
            now = tuple(
                m.get(f'kvcloud_worker_uploads_total{{result="{r}"}}', 0.0)
                for r in ("ok", "failed", "dropped")
            )
            idle = m.get("kvcloud_worker_upload_queue_depth", 0.0) == 0
            still = still + 1 if idle and now == last else 0
            last = now
            return still >= quiet

        return wait_for(settled, timeout, interval=0.2)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def close(self) -> None:
        self.kill()
        self.client.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start workers; every one still running is SIGKILLed at teardown."""
    started: list[Worker] = []

    def _spawn(name: str, store: str | None = None, index: str | None = None, **kw: Any) -> Worker:
        w = Worker(name, tmp_path, store, index, **kw)
        started.append(w)
        return w

    yield _spawn
    for w in started:
        w.close()


# -- the reference: a worker with no store -----------------------------------------------------


@dataclass
class Reference:
    """Token ids a worker with no store produces: what every other worker must answer."""

    worker: Worker
    cache: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tokens(self, prompt: str, max_tokens: int = 8) -> list[int]:
        key = (prompt, max_tokens)
        with self.lock:
            if key not in self.cache:
                out = self.worker.complete(body(prompt, max_tokens))
                self.cache[key] = out["choices"][0]["token_ids"]
            return self.cache[key]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    w = Worker("reference", tmp_path_factory.mktemp("reference"), None, None, cache_pages=64)
    yield Reference(w)
    w.close()


def answer(out: dict[str, Any]) -> list[int]:
    return out["choices"][0]["token_ids"]


# -- backends ----------------------------------------------------------------------------------


def s3_url(endpoint: str, prefix: str | None = None, **options: Any) -> str:
    prefix = prefix or f"faults-{uuid.uuid4().hex[:10]}"
    query = "&".join(
        [f"endpoint_url={endpoint}", "region=us-east-1", "create_bucket=true"]
        + [f"{k}={v}" for k, v in options.items()]
    )
    return f"s3://kvcloud/{prefix}?{query}"


def check_index(store_url: str, index_url: str) -> dict[str, Any]:
    """The invariant the faults must not break, checked independently of ``kvcloud verify``:
    every index entry names an object that exists, has the entry's size, hashes to its key
    and decodes as a segment of the entry's namespace and fingerprint. Objects nothing names
    are counted as orphans (harmless: gc reclaims them)."""
    from kvcloud.errors import CorruptObjectError, ObjectNotFoundError
    from kvcloud.indexes import open_index
    from kvcloud.segment import decode_segment, digest_from_key
    from kvcloud.stores import open_store

    problems: list[tuple[str, str, str]] = []
    ok = 0
    with open_store(store_url) as store, open_index(index_url) as index:
        # listed before the entries are read: an object registered after the listing is
        # fetched below like any other, never taken for missing
        objects = {info.key for info in store.list()}
        records = list({(r.ns, r.fp): r for r in index.iter_entries()}.values())
        blobs = store.get_many([r.entry.object_key for r in records])
        for rec, blob in zip(records, blobs, strict=True):
            key = rec.entry.object_key
            if isinstance(blob, ObjectNotFoundError):
                problems.append(("missing", rec.fp[:16], key))
            elif isinstance(blob, BaseException):
                raise blob  # the store failed: no verdict
            elif len(blob) != rec.entry.size:
                problems.append(("wrong_size", rec.fp[:16], f"{key}: {len(blob)} bytes"))
            else:
                try:
                    seg = decode_segment(blob, digest=digest_from_key(key))
                except CorruptObjectError as exc:
                    problems.append(("corrupt", rec.fp[:16], f"{key}: {exc}"))
                    continue
                if seg.header.fp.hex() != rec.fp or seg.header.ns != rec.ns:
                    problems.append(("wrong_object", rec.fp[:16], key))
                    continue
                ok += 1
        referenced = {r.entry.object_key for r in records}
    return {
        "entries": len(records),
        "ok": ok,
        "problems": problems,
        "objects": len(objects | referenced),
        "orphans": len(objects - referenced),
    }


def verify_cli(store_url: str, index_url: str, deep: bool = True) -> dict[str, Any] | None:
    """``kvcloud verify [--deep] --json``; None when this build has no verify command."""
    try:
        import kvcloud.tools.verify as maintenance
    except ImportError:
        return None
    if not hasattr(maintenance, "verify"):
        return None
    argv = [
        sys.executable,
        "-m",
        "kvcloud.tools.cli",
        "verify",
        "--store",
        store_url,
        "--index",
        index_url,
        "--json",
        *(["--deep"] if deep else []),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = {"stdout": proc.stdout[-2000:]}
    out["exit_status"] = proc.returncode
    out["stderr"] = proc.stderr[-2000:]
    return out


def assert_verified(
    store_url: str, index_url: str, obs: report.Observation | None = None
) -> dict[str, Any]:
    """No entry without a valid object: by this harness's own check and, where the build
    has it, by ``kvcloud verify --deep`` (exit status 0)."""
    own = check_index(store_url, index_url)
    cli = verify_cli(store_url, index_url)
    summary: dict[str, Any] = {
        "entries": own["entries"],
        "entries_valid": own["ok"],
        "objects": own["objects"],
        "objects_without_entry": own["orphans"],  # sessions may still name some
        "problems": own["problems"][:10],
    }
    if cli is not None:
        summary["kvcloud_verify_exit"] = cli["exit_status"]
        summary["kvcloud_verify"] = {
            k: cli.get(k)
            for k in (
                "entries_checked",
                "entries_ok",
                "missing",
                "wrong_size",
                "corrupt",
                "orphans",
                "clean",
            )
        }
    if obs is not None:
        obs.note(verify=summary)
    assert own["problems"] == [], own["problems"][:10]
    assert own["ok"] == own["entries"]
    if cli is not None:
        assert cli["exit_status"] == 0, cli
    return summary
