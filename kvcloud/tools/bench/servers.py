"""``--servers``: a local moto_server and redis-server on free ports for one bench run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .layout import BenchError


def find_server_binaries() -> tuple[str, str]:
    """(moto_server, redis-server) paths, or a BenchError naming what to install."""
    # moto_server lives in the venv's bin/, which need not be on PATH (``.venv/bin/kvcloud``)
    beside = Path(sys.executable).with_name("moto_server")
    moto = str(beside) if os.access(beside, os.X_OK) else shutil.which("moto_server")
    redis = shutil.which("redis-server")
    missing = []
    if moto is None:
        missing.append("moto_server (pip install 'moto[server]')")
    if redis is None:
        missing.append("redis-server (apt-get install -y redis-server, or brew install redis)")
    if missing:
        raise BenchError("--servers needs " + " and ".join(missing) + " on PATH")
    assert moto is not None and redis is not None
    return moto, redis


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], port: int, log_path: Path, timeout: float = 30.0) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        # A session of its own: Ctrl-C reaches only us, and our cleanup stops the server.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise BenchError(f"{argv[0]} exited with {proc.returncode}:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.05)
    _stop(proc)
    raise BenchError(f"{argv[0]} did not listen on port {port} within {timeout:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def _env(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def local_servers() -> Iterator[tuple[str, str]]:
    """Start moto_server and redis-server on free ports in a temp dir; yield (store, index).

    Dummy AWS credentials are set for the duration (moto accepts any), so the user's real
    ones are never sent anywhere, not even to a local server.
    """
    moto_bin, redis_bin = find_server_binaries()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcloud-bench-")))
        moto_port, redis_port = _free_port(), _free_port()
        moto = _start(
            [moto_bin, "-H", "127.0.0.1", "-p", str(moto_port)], moto_port, workdir / "moto.log"
        )
        stack.callback(_stop, moto)
        redis = _start(
            [
                redis_bin,
                *("--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(workdir)),
                *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            ],
            redis_port,
            workdir / "redis.log",
        )
        stack.callback(_stop, redis)
        stack.enter_context(
            _env(
                {
                    "AWS_ACCESS_KEY_ID": "kvcloud-bench",
                    "AWS_SECRET_ACCESS_KEY": "kvcloud-bench",
                    "AWS_SESSION_TOKEN": None,
                    "AWS_PROFILE": None,
                }
            )
        )
        store = (
            f"s3://kvcloud-bench/segments?endpoint_url=http://127.0.0.1:{moto_port}"
            "&region=us-east-1&create_bucket=true"
        )
        yield store, f"redis://127.0.0.1:{redis_port}/0"
