from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcloud import KVCloud
from tests.servers import MotoServer


@dataclass(frozen=True)
class Backends:
    name: str
    store: str
    index: str

    def open(self, **kw: object) -> KVCloud:
        return KVCloud.open(store=self.store, index=self.index, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["embedded", "servers"])
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backends]:
    """file:// + sqlite:// (the embedded default) and moto_server + redis-server processes."""
    if request.param == "embedded":
        yield Backends(
            "embedded", f"file://{tmp_path / 'objects'}", f"sqlite://{tmp_path / 'index.db'}"
        )
    else:
        moto: MotoServer = request.getfixturevalue("moto_server")
        redis_url: str = request.getfixturevalue("redis_url")
        prefix = f"t-{uuid.uuid4().hex[:12]}"
        yield Backends(
            "servers",
            f"s3://kvcloud/{prefix}?endpoint_url={moto.endpoint}"
            "&region=us-east-1&create_bucket=true",
            redis_url,
        )
