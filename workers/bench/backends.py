"""The stores and indexes a benchmark runs against: ``file://`` + ``sqlite://`` in a work
directory, and/or kvcloud's own bench servers (moto_server + redis-server)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Backend:
    name: str  # "file" or "servers"
    store: str
    index: str
    s3_endpoint: str | None = None
    bucket: str | None = None
    prefix: str | None = None
    naive_dir: str | None = None


@dataclass(frozen=True)
class _Servers:
    s3_endpoint: str
    redis_url: str


@contextlib.contextmanager
def local_servers(workdir: Path) -> Iterator[_Servers]:
    """kvcloud's own bench servers (moto_server + redis-server), as endpoints."""
    from urllib.parse import parse_qs, urlsplit

    from kvcloud.tools.bench import local_servers as _kvcloud_servers

    del workdir  # kvcloud's helper keeps its own temp dir
    with _kvcloud_servers() as (store, index):
        endpoint = parse_qs(urlsplit(store).query)["endpoint_url"][0]
        yield _Servers(endpoint, index)


@contextlib.contextmanager
def open_backends(names: list[str], workdir: Path) -> Iterator[list[Backend]]:
    """file:// + sqlite:// in ``workdir``, and/or a moto_server + redis-server started here."""
    with contextlib.ExitStack() as stack:
        out = []
        for name in names:
            if name == "file":
                d = workdir / "file"
                d.mkdir(parents=True, exist_ok=True)
                out.append(
                    Backend(
                        "file",
                        f"file://{d / 'objects'}",
                        f"sqlite://{d / 'index.db'}",
                        naive_dir=str(d / "naive"),
                    )
                )
            elif name == "servers":
                servers = stack.enter_context(local_servers(workdir / "servers"))
                store = (
                    f"s3://kvbench/ttft?endpoint_url={servers.s3_endpoint}"
                    "&region=us-east-1&create_bucket=true"
                )
                out.append(
                    Backend(
                        "servers",
                        store,
                        servers.redis_url,
                        s3_endpoint=servers.s3_endpoint,
                        bucket="kvbench",
                        prefix="naive",
                    )
                )
            else:
                raise ValueError(f"unknown backend {name!r}: use file and/or servers")
        yield out
