"""Redis Cluster index: the Redis index, with keys spread over the cluster's slots.

URL: ``redis+cluster://[user:password@]host:port[,host:port...][/0]?prefix=kvc&ttl=604800``
(``rediss+cluster://`` for TLS). The hosts are startup nodes: any reachable one is enough to
discover the cluster; list several so that one being down at startup does not matter.

The key schema is :class:`~kvcloud.indexes.redis.RedisIndex`'s (laid out in
:mod:`~kvcloud.indexes.redis_layout`), which carries no hash tags on purpose: each bucket
hashes to its own slot, so a hot namespace spreads over every master
instead of pinning one. That rules out multi-key commands across entries, so this variant
(``_single_key``) turns the multi-key paths of RedisIndex into single-key ones:

- ``lookup`` is a non-transactional pipeline of HGETs, which redis-py's cluster client groups
  by node and sends to every node involved before reading any reply (one round trip per node,
  in parallel), instead of one chain-walking script; expiry is checked on the client;
- registrations and the background TTL renewals are pipelines of one-key scripts (sent as
  EVAL, since a cluster pipeline cannot load a script on the node it lands on).

Everything else already touches a single key per command: the compare-and-drop script has
one key, sessions are one key each, and SCAN runs on every master.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import exceptions as rexc
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import Encoder

from ..errors import ConfigError, IndexBackendError, IndexUnavailableError
from .redis import RedisIndex

DEFAULT_PORT = 6379


def parse_startup_nodes(netloc: str) -> tuple[str, list[tuple[str, int]]]:
    """Split ``[userinfo@]host:port,host:port`` into the userinfo and (host, port) pairs.

    Raises ConfigError for an empty list or a bad port. IPv6 hosts go in brackets.
    """
    userinfo, _, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            parsed = urlsplit("//" + part)
            host, port = parsed.hostname, parsed.port
        except ValueError:
            raise ConfigError(f"bad Redis Cluster node {part!r} (host:port)") from None
        if not host:
            raise ConfigError(f"bad Redis Cluster node {part!r} (host:port)")
        nodes.append((host, port or DEFAULT_PORT))
    if not nodes:
        raise ConfigError("a redis+cluster:// URL needs at least one host:port")
    return userinfo, nodes


class _LazyCluster:
    """A RedisCluster client that connects on first use.

    RedisCluster discovers the topology in its constructor, so a cluster that is down when a
    worker starts would fail the worker. The plain Redis index connects lazily (an outage is a
    miss, never a crash), and so does this: the first command builds the client, and a failed
    build is a ConnectionError (an IndexUnavailableError to callers) that the next command
    tries again.
    """

    def __init__(self, factory: Callable[[], RedisCluster]) -> None:
        self._factory = factory
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()
        # Script() asks for the encoder when it is registered, before any connection.
        self._encoder = Encoder("utf-8", "strict", False)

    def _get(self) -> RedisCluster:
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._factory()
                except rexc.RedisError:
                    raise
                except rexc.RedisClusterException as exc:
                    # "cannot connect to any startup node" is not a RedisError; make it the
                    # connection error it is
                    raise rexc.ConnectionError(str(exc)) from exc
            return self._client

    def get_encoder(self) -> Encoder:
        return self._encoder

    def pipeline(self, **kwargs: Any) -> Any:
        # RedisIndex builds pipelines outside its error mapping (building one is free on a
        # plain client), so building one must not connect: before the first connection, the
        # commands are recorded and replayed into a real pipeline at execute().
        client = self._client
        if client is not None:
            return client.pipeline(**kwargs)
        return _DeferredPipeline(self, kwargs)

    def register_script(self, script: str) -> Script:
        # bound to this wrapper, so the script connects lazily too
        return Script(self, script)  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)


class _DeferredPipeline:
    """Records pipeline commands until ``execute``, which connects first (see pipeline())."""

    def __init__(self, lazy: _LazyCluster, kwargs: dict[str, Any]) -> None:
        self._lazy = lazy
        self._kwargs = kwargs
        self._calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., _DeferredPipeline]:
        def record(*args: Any, **kwargs: Any) -> _DeferredPipeline:
            self._calls.append((name, args, kwargs))
            return self

        return record

    def __len__(self) -> int:
        return len(self._calls)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        pipe = self._lazy._get().pipeline(**self._kwargs)
        for name, args, kwargs in self._calls:
            getattr(pipe, name)(*args, **kwargs)
        return pipe.execute(raise_on_error=raise_on_error)


class RedisClusterIndex(RedisIndex):
    """Index in a Redis Cluster (``redis+cluster://`` or TLS ``rediss+cluster://``).

    Same behaviour and options as :class:`RedisIndex` (``prefix``, ``ttl``, redis-py options
    in the query string); ``/0`` is the only database a cluster has.
    """

    scheme_names: tuple[str, ...] = ("redis+cluster", "rediss+cluster")

    # The multi-key scripts need every key in one slot; buckets are spread over slots by
    # design.
    _single_key = True
    # RedisCluster runs the connection handshake before a connect hook (no_touch=on)
    _hook_runs_handshake = False

    def _make_client(self, url: str, **kwargs: Any) -> Any:
        parts = urlsplit(url)
        if parts.path not in ("", "/", "/0"):
            raise ConfigError(
                f"index URL {self.url!r}: a Redis Cluster has only database 0, not {parts.path!r}"
            )
        userinfo, nodes = parse_startup_nodes(parts.netloc)
        scheme = "rediss" if parts.scheme.lower().startswith("rediss") else "redis"
        (host, port), rest = nodes[0], nodes[1:]
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if userinfo:
            netloc = f"{userinfo}@{netloc}"
        # redis-py parses the first node (and credentials, TLS and query options) from a
        # single-node URL; the other startup nodes are passed as such.
        first = urlunsplit((scheme, netloc, "/0", parts.query, ""))
        startup = [ClusterNode(h, p) for h, p in rest]

        def factory() -> RedisCluster:
            return RedisCluster(url=first, startup_nodes=list(startup), **kwargs)

        return _LazyCluster(factory)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            with super()._errors():
                yield
        except rexc.RedisClusterException as exc:
            # Raised outside the RedisError hierarchy. A slot nobody serves or no reachable
            # node means the same to callers as a refused connection: a miss, not a crash.
            text = self._scrub(str(exc))
            if isinstance(exc, rexc.SlotNotCoveredError) or "cannot be connected" in text:
                raise IndexUnavailableError(
                    f"redis cluster index {self.url} is unavailable ({type(exc).__name__}: "
                    f"{text}); check that every master is up and reachable"
                ) from exc
            raise IndexBackendError(
                f"redis cluster index {self.url}: {type(exc).__name__}: {text}"
            ) from exc


__all__ = ["RedisClusterIndex", "parse_startup_nodes"]
