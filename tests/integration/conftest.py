from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcloud import KVCloud
from tests.ceph import CephRGW


@dataclass(frozen=True)
class Backends:
    name: str
    store: str
    index: str

    def open(self, **kw: object) -> KVCloud:
        return KVCloud.open(store=self.store, index=self.index, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["embedded", "servers"])
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backends]:
    """file:// + sqlite:// (the embedded default) and Ceph RGW + redis-server processes."""
    if request.param == "embedded":
        yield Backends(
            "embedded", f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
        )
    else:
        ceph: CephRGW = request.getfixturevalue("ceph_rgw")
        redis_url: str = request.getfixturevalue("redis_url")
        yield Backends(
            "servers", ceph.store_url("kvcloud", f"t-{uuid.uuid4().hex[:12]}"), redis_url
        )
