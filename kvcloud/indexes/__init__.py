"""Indexes, chosen by URL (see open_index)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..errors import ConfigError
from ..urls import redact_url, split_url
from .base import DEFAULT_TTL_SECONDS, EntryRecord, Index, IndexEntry, IndexSummary
from .sqlite import SQLiteIndex

if TYPE_CHECKING:
    from .cluster import RedisClusterIndex
    from .redis import RedisIndex

KNOWN_SCHEMES = ("sqlite", "redis", "rediss", "redis+cluster", "rediss+cluster")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def _redis_module() -> Any:
    # redis-py is an optional extra; only users of a redis:// index need it installed.
    try:
        from . import redis as redis_index
    except ModuleNotFoundError as exc:
        if exc.name != "redis" and not (exc.name or "").startswith("redis."):
            raise
        raise ConfigError("a redis:// index needs redis-py: pip install kvcloud[redis]") from None
    return redis_index


def _cluster_module() -> Any:
    _redis_module()  # the same optional extra, with the same message when it is missing
    from . import cluster as cluster_index

    return cluster_index


def sqlite_path(netloc: str, path: str) -> str:
    # sqlite:///abs/index.db → "/abs/index.db"; sqlite://rel/index.db → "rel/index.db"
    full = unquote(netloc + path)
    if not full:
        raise ConfigError("sqlite index URL needs a path: sqlite:///abs/index.db")
    return full


def open_index(
    url: str,
    *,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
    connect_timeout: float = 2.0,
    read_timeout: float = 5.0,
    no_touch: bool = False,
) -> Index:
    """Open the index a URL names.

    ``sqlite:///abs/path.db`` or ``sqlite://relative/path.db`` (options: ``busy_timeout``,
    ``ttl``); ``redis://[user:password@]host:port/db`` or ``rediss://…`` (options:
    ``prefix``, ``ttl``); ``redis+cluster://[user:password@]host:port[,host:port…]`` or
    ``rediss+cluster://…`` for a Redis Cluster (same options; the hosts are startup nodes).
    A ``ttl`` in the URL overrides ``ttl_seconds``. ``no_touch``: a Redis index's reads leave
    the keys' LRU/LFU clocks as they were (the URL option ``no_touch=on``; SQLite has none).
    """
    scheme, netloc, path, options = split_url(url)
    if scheme == "sqlite":
        try:
            ttl = int(options.get("ttl", ttl_seconds))
            busy_timeout = float(options.get("busy_timeout", 10.0))
        except ValueError as exc:
            raise ConfigError(f"index URL {redact_url(url)!r}: {exc}") from None
        if ttl <= 0:
            raise ConfigError(f"index URL {redact_url(url)!r}: ttl must be positive")
        return SQLiteIndex(sqlite_path(netloc, path), ttl, busy_timeout=busy_timeout)
    if scheme in ("redis", "rediss"):
        return _redis_module().RedisIndex(
            url,
            ttl_seconds,
            socket_connect_timeout=connect_timeout,
            socket_timeout=read_timeout,
            no_touch=no_touch,
        )
    if scheme in CLUSTER_SCHEMES:
        return _cluster_module().RedisClusterIndex(
            url,
            ttl_seconds,
            socket_connect_timeout=connect_timeout,
            socket_timeout=read_timeout,
            no_touch=no_touch,
        )
    raise ConfigError(
        f"unknown index URL scheme {scheme!r} in {redact_url(url)!r}; known: "
        + ", ".join(f"{s}://" for s in KNOWN_SCHEMES)
    )


def __getattr__(name: str) -> Any:
    if name == "RedisIndex":
        return _redis_module().RedisIndex
    if name == "RedisClusterIndex":
        return _cluster_module().RedisClusterIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_TTL_SECONDS",
    "KNOWN_SCHEMES",
    "EntryRecord",
    "Index",
    "IndexEntry",
    "IndexSummary",
    "RedisClusterIndex",
    "RedisIndex",
    "SQLiteIndex",
    "open_index",
]
