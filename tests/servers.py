"""Real server processes for tests: redis-server and moto_server on free ports.

Each handle can stop (SIGTERM), kill (SIGKILL), pause (SIGSTOP), resume and restart its
process, so fault-injection tests can do to it what production does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


@dataclass
class ServerProcess:
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> ServerProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        wait_port(self.port, proc=self.proc)
        return self

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()


@dataclass
class RedisServer(ServerProcess):
    dir: Path = Path(".")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_redis(workdir: Path, persistence: bool = False) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found; install it (apt-get install -y redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "yes" if persistence else "no",
        "--protected-mode",
        "no",
        "--daemonize",
        "no",
    ]
    server = RedisServer(argv=argv, port=port, log_path=workdir / "redis.log", dir=workdir)
    return server.start()  # type: ignore[return-value]


@dataclass
class MotoServer(ServerProcess):
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def store_url(self, bucket: str = "kvcloud", prefix: str = "segments") -> str:
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"


def start_moto(workdir: Path) -> MotoServer:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    argv = [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    server = MotoServer(argv=argv, port=port, log_path=workdir / "moto.log")
    return server.start()  # type: ignore[return-value]


def s3_env(endpoint: str) -> dict[str, str]:
    """Dummy credentials moto accepts; real deployments use the AWS chain."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
