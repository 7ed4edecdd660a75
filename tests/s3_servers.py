"""The S3 servers the suite starts, by name, and the one type that covers them all.

Each has ``endpoint``, ``store_url(bucket, prefix)`` and ``env()`` (the credentials it
accepts). A test takes the ``s3_server`` fixture (tests/conftest.py), Ceph RGW by default,
or parametrizes it by name with ``indirect=True``.
"""

from __future__ import annotations

from tests.ceph import CephRGW
from tests.rclone import RcloneS3
from tests.servers import MotoServer
from tests.swift import SwiftS3

S3Server = CephRGW | SwiftS3 | RcloneS3 | MotoServer

#: name → session fixture: Ceph RGW (a production server that honours conditional writes),
#: Swift s3api (refuses them: 501), rclone serve s3 (ignores them), moto_server (an emulator)
S3_SERVERS = {"ceph": "ceph_rgw", "swift": "swift_s3", "rclone": "rclone_s3", "moto": "moto_server"}

#: the servers that do not honour If-None-Match, for the invariants that depend on it
WITHOUT_CONDITIONAL_WRITES = ("swift", "rclone")


def server_name(server: S3Server) -> str:
    """What the reliability report calls it."""
    names = {CephRGW: "Ceph RGW", SwiftS3: "Swift s3api", RcloneS3: "rclone serve s3"}
    return names.get(type(server), "moto_server")
