"""OpenStack Swift with its S3 API (the ``s3api`` middleware), started by the tests on free ports.

Why: Swift's S3 layer is a real, widely deployed S3 server that does *not* honour conditional
writes (``If-None-Match: *`` on PUT is answered 501 NotImplemented), so it shows what the
store does against a backend without them. Debian's packages (``swift swift-proxy
swift-object swift-container swift-account``, installed by ``scripts/system-deps.sh``); the
``s3api`` middleware ships in ``python3-swift`` itself (Swift >= 2.18).

Four processes, each in the foreground (``workers = 0``: no forking, no privilege drop) as the
current user: account, container and object servers on one-replica rings, and the proxy with
``s3api`` + ``tempauth``. No systemd, rsync, replicators or memcached: the proxy's ``cache``
filter (which tempauth insists on) points at a loopback port nothing listens on, so every
lookup misses and nothing is shared between instances.

tempauth names S3 users ``account:user``, so the access key cannot be the suite's bare dummy
key: it is :data:`ACCESS_KEY` (``testing:testing``) with the suite's secret; use
:meth:`SwiftS3.env`. Other quirks: DeleteObjects wants ``Content-MD5`` (botocore now sends a
CRC32 instead: 400 InvalidRequest), and an in-place copy needs ``MetadataDirective=REPLACE``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers import ServerProcess, free_port, s3_env, wait_s3_ready

_SUITE_KEY = s3_env("")["AWS_ACCESS_KEY_ID"]
ACCOUNT = USER = _SUITE_KEY
ACCESS_KEY = f"{ACCOUNT}:{USER}"  # tempauth's S3 access key is "account:user"
SECRET_KEY = s3_env("")["AWS_SECRET_ACCESS_KEY"]
SERVERS = ("account", "container", "object")
BINARIES = ("swift-ring-builder", *(f"swift-{s}-server" for s in (*SERVERS, "proxy")))
# nothing listens here (port 9, "discard", below 1024 so no unprivileged process takes it):
# memcache calls fail at once and are error-limited, tempauth just sees cache misses
_NO_MEMCACHE = "127.0.0.1:9"


def swift_missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _common(d: Path, port: int) -> str:
    return f"""[DEFAULT]
bind_ip = 127.0.0.1
bind_port = {port}
workers = 0
user = {pwd.getpwuid(os.getuid()).pw_name}
swift_dir = {d}
devices = {d}/srv
mount_check = false
disable_fallocate = true
log_level = WARNING
log_address = {d}/no-syslog
"""


def _server_conf(d: Path, kind: str, port: int) -> str:
    return (
        _common(d, port)
        + f"""
[pipeline:main]
pipeline = {kind}-server

[app:{kind}-server]
use = egg:swift#{kind}
"""
    )


# the proxy's middleware, in order (the filter names are also their entry points, with "-"
# for "_"); catch_errors, gatekeeper, listing_formats, copy, dlo and versioned_writes would
# be inserted by the proxy if left out, slo is what s3api's multipart uploads are made of
_PIPELINE = (
    "catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth "
    "copy slo dlo versioned_writes proxy-logging"
)
_FILTER_OPTIONS = {
    "s3api": "location = us-east-1\n",
    "tempauth": f"user_{ACCOUNT}_{USER} = {SECRET_KEY} .admin\n",
    # set: the filter's own logger, so its connection errors don't fill the log
    "cache": f"memcache_servers = {_NO_MEMCACHE}\nset log_level = CRITICAL\n",
}
_ENTRY_POINTS = {"cache": "memcache"}


def _proxy_conf(d: Path, port: int) -> str:
    filters = "".join(
        f"\n[filter:{name}]\nuse = egg:swift#{_ENTRY_POINTS.get(name, name.replace('-', '_'))}\n"
        + _FILTER_OPTIONS.get(name, "")
        for name in dict.fromkeys(_PIPELINE.split())
    )
    return (
        _common(d, port)
        + f"""
[pipeline:main]
pipeline = {_PIPELINE} proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
"""
        + filters
    )


@dataclass
class SwiftS3:
    """Handles on the four servers; ``endpoint`` is the proxy's S3 endpoint (path-style)."""

    dir: Path
    proxy_port: int
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def env(self) -> dict[str, str]:
        """The suite's S3 environment, with tempauth's ``account:user`` access key."""
        return {
            **s3_env(self.endpoint),
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def store_url(self, bucket: str = "kvcloud", prefix: str = "") -> str:
        path = f"/{prefix}" if prefix else ""
        return (
            f"s3://{bucket}{path}?endpoint_url={self.endpoint}&region=us-east-1"
            "&addressing_style=path&create_bucket=true"
        )

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers.values() if s.proc and s.proc.poll() is None]

    def tail(self, n: int = 20) -> str:
        out = []
        for name, server in self.servers.items():
            if server.log_path.exists():
                lines = server.log_path.read_text(errors="replace").splitlines()[-n:]
                out.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        # proxy first, so no request is half-way through the storage servers when they go
        for name in ("proxy", *reversed(SERVERS)):
            if name in self.servers:
                self.servers[name].stop()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until S3 works: the proxy is up, tempauth and s3api are loaded and the account
        server answers (the account is made on first use)."""

        def exited() -> str | None:
            for name, server in self.servers.items():
                if server.proc is not None and server.proc.poll() is not None:
                    return f"the swift {name} server exited: {self.tail()}"
            return None

        wait_s3_ready(
            self.endpoint,
            ACCESS_KEY,
            SECRET_KEY,
            exited=exited,
            what="swift s3api",
            timeout=timeout,
        )


def _build_rings(d: Path, ports: dict[str, int], part_power: int) -> None:
    """One-replica rings with one device each, made in one Python process: the nine
    ``swift-ring-builder`` runs it replaces take about 1 s each here."""
    script = """
import sys
from swift.common.ring import RingBuilder
d, part_power = sys.argv[1], int(sys.argv[2])
for arg in sys.argv[3:]:
    kind, port = arg.split("=")
    b = RingBuilder(part_power, 1, 1)
    b.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port),
               "device": "d1", "weight": 100, "meta": ""})
    b.rebalance()
    b.save(f"{d}/{kind}.builder")
    b.get_ring().save(f"{d}/{kind}.ring.gz")
"""
    subprocess.run(
        [*_swift_python(), "-c", script, str(d), str(part_power),
         *(f"{k}={p}" for k, p in ports.items())],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


# Swift's servers validate /etc/swift/swift.conf before they read their own config's swift_dir;
# a package install without that file (seen on CI) fails them all. Point Swift at this
# cluster's swift.conf first, then run the packaged server script as its own __main__.
_LAUNCH = (
    "import runpy, shutil, sys; from swift.common.utils import set_swift_dir; "
    "set_swift_dir(sys.argv[1]); script = shutil.which(sys.argv[2]); "
    "sys.argv = [script, *sys.argv[3:]]; runpy.run_path(script, run_name='__main__')"
)


def _in_dir(d: Path, binary: str) -> list[str]:
    """argv prefix running Swift's ``binary`` with ``d/swift.conf`` as its swift.conf."""
    return [*_swift_python(), "-c", _LAUNCH, str(d), binary]


def _swift_python() -> list[str]:
    """The interpreter Swift is installed for (Debian's /usr/bin/python3, not the tests'
    venv), from its scripts' shebang line."""
    script = Path(shutil.which("swift-ring-builder") or "swift-ring-builder")
    return script.read_text().splitlines()[0].removeprefix("#!").split()


def start_swift_s3(workdir: Path, part_power: int = 6, timeout: float = 60.0) -> SwiftS3:
    """Configure and start Swift in ``workdir``; returns once S3 ListBuckets works. Raises
    with the servers' log tails (and stops what it started) if it does not come up."""
    missing = swift_missing()
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not found; install them (apt-get install -y "
            "--no-install-recommends swift swift-proxy swift-object swift-container "
            "swift-account)"
        )
    d = workdir
    (d / "srv" / "d1").mkdir(parents=True, exist_ok=True)
    (d / "log").mkdir(exist_ok=True)
    (d / "swift.conf").write_text(
        "[swift-hash]\nswift_hash_path_prefix = kvcloud\nswift_hash_path_suffix = tests\n\n"
        "[storage-policy:0]\nname = Policy-0\ndefault = yes\n"
    )
    ports = {kind: free_port() for kind in SERVERS}
    _build_rings(d, ports, part_power)
    cluster = SwiftS3(dir=d, proxy_port=free_port())
    confs = {kind: _server_conf(d, kind, port) for kind, port in ports.items()}
    confs["proxy"] = _proxy_conf(d, cluster.proxy_port)
    try:
        for name, text in confs.items():
            conf = d / f"{name}-server.conf"
            conf.write_text(text)
            # -v: log to stderr too (the file below); there is no syslog here
            server = ServerProcess(
                argv=[*_in_dir(d, f"swift-{name}-server"), str(conf), "-v"],
                port=cluster.proxy_port if name == "proxy" else ports[name],
                log_path=d / "log" / f"{name}.log",
            )
            cluster.servers[name] = server
            log = open(server.log_path, "ab")  # noqa: SIM115 - lives as long as the process
            server.proc = subprocess.Popen(
                server.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            log.close()
        cluster.wait_ready(timeout)
    except BaseException:
        print(cluster.tail())
        cluster.stop()
        raise
    return cluster
