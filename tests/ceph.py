"""A one-node Ceph cluster with an S3 gateway (RGW), started by the tests on free ports.

One monitor, one OSD on ``memstore`` (data in RAM, capped, gone when it stops), no manager,
authentication off, and ``radosgw`` with the ``beast`` frontend on a loopback port, plus one
S3 user. Debian's packages (``ceph-mon ceph-osd radosgw``, installed by
``scripts/system-deps.sh``). This is the S3 implementation many self-hosted and OpenStack
clouds run: the stand-in for MinIO, whose server is not installable here.

Each daemon is its own process in the foreground, so a test can stop the OSD during a pull or
restart the gateway during a push.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.servers import ServerProcess, free_port, s3_env

# the suite's dummy credentials (tests/servers.py s3_env), which every test process and worker
# already has in its environment: the same tests can talk to moto_server and to Ceph
ACCESS_KEY = s3_env("")["AWS_ACCESS_KEY_ID"]
SECRET_KEY = s3_env("")["AWS_SECRET_ACCESS_KEY"]
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")


def ceph_missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _conf(d: Path, fsid: str, mon_port: int, rgw_port: int, osd_bytes: int) -> str:
    return f"""[global]
fsid = {fsid}
mon_host = v1:127.0.0.1:{mon_port}
ms_bind_msgr2 = false
ms_bind_ipv4 = true
ms_bind_ipv6 = false
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
auth_allow_insecure_global_id_reclaim = true
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 2000
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
osd_objectstore = memstore
osd_fast_shutdown = false
osd_crush_update_on_start = false
osd_class_update_on_start = false
memstore_device_bytes = {osd_bytes}
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
log_file = {d}/log/$name.log
pid_file = {d}/run/$name.pid
keyring = {d}/keyring
mon_data = {d}/mon/$cluster-$id
osd_data = {d}/osd/$cluster-$id
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw_thread_pool_size = 64
debug_rgw = 0
"""


@dataclass
class CephRGW:
    """Handles on the three daemons; ``endpoint`` is the S3 endpoint (path-style)."""

    dir: Path
    conf: Path
    rgw_port: int
    mon: ServerProcess
    osd: subprocess.Popen | None = None
    rgw: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def env(self) -> dict[str, str]:
        return s3_env(self.endpoint)  # the user was made with the suite's dummy credentials

    def store_url(self, bucket: str = "kvcloud", prefix: str = "") -> str:
        path = f"/{prefix}" if prefix else ""
        return (
            f"s3://{bucket}{path}?endpoint_url={self.endpoint}&region=us-east-1"
            "&addressing_style=path&create_bucket=true"
        )

    def _ceph(self, *args: str, timeout: float = 30, within: float = 30) -> str:
        """One ``ceph`` CLI command (each here is idempotent), asked again until it
        succeeds or ``within`` seconds passed. A client that asks before it has the monitor
        map sends a zero fsid and is refused ("wrong fsid", EPERM); on a loaded machine
        (CI) five tries 0.2 s apart were all refused once, so it is a deadline now."""
        deadline = time.monotonic() + within
        while True:
            proc = subprocess.run(
                ["ceph", "-c", str(self.conf), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if proc.returncode == 0:
                return proc.stdout
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ceph {' '.join(args)} failed with {proc.returncode}: "
                    f"{proc.stderr.strip()[-500:]}"
                )
            time.sleep(0.3)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.dir / "log" / f"{name}.out"
        self.logs.append(log)
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_osd(self, timeout: float = 60, attempts: int = 3) -> None:
        deadline = time.monotonic() + timeout
        for attempt in range(attempts):
            self.osd = self._spawn("osd.0", ["ceph-osd", "-c", str(self.conf), "-i", "0", "-f"])
            while '"num_up_osds":1' not in self._ceph("osd", "stat", "-f", "json").replace(" ", ""):
                if self.osd.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OSD did not come up: {self.tail()}")
                time.sleep(0.2)
            else:
                return
            # a freshly made OSD sometimes asks the monitor before it has the cluster's map
            # ("wrong fsid") and exits; started again, it has it
            if attempt == attempts - 1:
                raise RuntimeError(f"ceph-osd exited with {self.osd.returncode}: {self.tail()}")
            time.sleep(0.5)

    def start_rgw(self, timeout: float = 60) -> None:
        self.rgw = self._spawn("rgw", ["radosgw", "-c", str(self.conf), "-n", "client.rgw", "-f"])
        deadline = time.monotonic() + timeout
        while True:
            if self.rgw.poll() is not None:
                raise RuntimeError(f"radosgw exited with {self.rgw.returncode}: {self.tail()}")
            try:
                if httpx.get(self.endpoint, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"radosgw did not answer: {self.tail()}")
            time.sleep(0.2)

    @staticmethod
    def _end(proc: subprocess.Popen | None, timeout: float = 20) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def stop_osd(self) -> None:
        self._end(self.osd)

    def stop_rgw(self) -> None:
        self._end(self.rgw)

    def restart_rgw(self) -> None:
        self.stop_rgw()
        self.start_rgw()

    def osd_full(self) -> bool:
        """Ceph flags the OSD full (past ``mon_osd_full_ratio``): writes are held, reads go on."""
        return '"OSD_FULL"' in self._ceph("health", "-f", "json")

    def set_full_ratio(self, ratio: float) -> None:
        self._ceph("osd", "set-full-ratio", str(ratio))

    def tail(self, n: int = 20) -> str:
        out = []
        for log in [*self.logs, *sorted((self.dir / "log").glob("*.log"))]:
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()[-n:]
                out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        self._end(self.rgw)
        self._end(self.osd)
        self.mon.stop()


def start_ceph_rgw(workdir: Path, osd_bytes: int = 1 << 30) -> CephRGW:
    """Create and start the cluster in ``workdir`` (about 15 s here); raises with the daemons'
    log tails if it does not come up."""
    missing = ceph_missing()
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not found; install them "
            "(apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw)"
        )
    d = workdir
    for sub in ("run", "log", "mon/ceph-a", "osd/ceph-0"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    mon_port, rgw_port = free_port(), free_port()
    conf = d / "ceph.conf"
    conf.write_text(_conf(d, fsid, mon_port, rgw_port, osd_bytes))
    (d / "keyring").write_text("")

    def run(*argv: str, attempts: int = 1) -> None:
        for attempt in range(attempts):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                return
            if attempt == attempts - 1:
                raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
            time.sleep(0.5)  # a monitor client refused before it had the map (see _ceph)

    # msgr v1 only (ms_bind_msgr2 off): the map must say so, or daemons dial a v2 address
    run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v1:127.0.0.1:{mon_port}]",
        str(d / "monmap"))  # fmt: skip
    run("ceph-mon", "-c", str(conf), "--mkfs", "-i", "a", "--monmap", str(d / "monmap"))
    mon = ServerProcess(
        argv=["ceph-mon", "-c", str(conf), "-i", "a", "-f"],
        port=mon_port,
        log_path=d / "log" / "mon.a.out",
    )
    cluster = CephRGW(dir=d, conf=conf, rgw_port=rgw_port, mon=mon.start())
    try:
        osd_uuid = str(uuid.uuid4())  # the OSD checks the map's uuid for its id against its own
        osd_id = cluster._ceph("osd", "create", osd_uuid).strip()
        assert osd_id == "0", osd_id
        # placed by this client (which retries a refusal), not by the OSD at start: an OSD
        # that sends its crush update before it has the cluster's map is refused ("wrong
        # fsid", EPERM) and its init fails; in CI all three starts of one run failed so
        cluster._ceph("osd", "crush", "add", "osd.0", "1.0", "root=default", "host=kvcloud")
        run("ceph-osd", "-c", str(conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        cluster.start_osd()
        cluster.start_rgw()
        run("radosgw-admin", "-c", str(conf), "user", "create", "--uid", "kvcloud",
            "--display-name", "kvcloud tests", "--access-key", ACCESS_KEY,
            "--secret-key", SECRET_KEY, attempts=5)  # fmt: skip
    except BaseException:
        print(cluster.tail())  # the daemons' logs go with the failure
        cluster.stop()
        raise
    return cluster
