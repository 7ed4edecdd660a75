"""Typed configuration. Each field names the environment variable that sets it.

URLs choose the backends (DESIGN §6); backend-specific options travel in the URL's query
string (``s3://bucket/prefix?endpoint_url=…&region=…``) so one string configures a worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .urls import env_bool

if TYPE_CHECKING:
    from .indexes.base import Index
    from .stores.base import ObjectStore

log = logging.getLogger("kvcloud")

# Used when KVCLOUD_SECRET is unset, so a laptop demo works; logged loudly because with it
# anyone can compute anyone's fingerprints.
INSECURE_DEFAULT_SECRET = b"kvcloud-insecure-default-secret"


def default_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcloud"


def default_store_url() -> str:
    return f"file://{default_home() / 'objects'}"


def default_index_url() -> str:
    return f"sqlite://{default_home() / 'index.db'}"


def env_values(cls: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Values for a dataclass from the environment variables named in its fields' metadata
    (``metadata={"env": NAME}``), converted by field type; a bad value is a ConfigError that
    names the variable."""
    source = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in fields(cls):
        name = f.metadata.get("env")
        raw = source.get(name) if name else None
        if not raw:
            continue
        try:
            if f.type in ("bool", bool):
                values[f.name] = env_bool(raw)
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return values


@dataclass
class KVCloudConfig:
    """Client configuration. ``from_env`` reads the variable named in each field's metadata."""

    store: str = field(default_factory=default_store_url, metadata={"env": "KVCLOUD_STORE"})
    """Object store URL: ``s3://bucket/prefix?endpoint_url=…&region=…`` or ``file:///path``."""

    index: str = field(default_factory=default_index_url, metadata={"env": "KVCLOUD_INDEX"})
    """Index URL: ``redis://host:6379/0``, ``rediss://…`` or ``sqlite:///path/index.db``."""

    secret: bytes = field(
        default=INSECURE_DEFAULT_SECRET, repr=False, metadata={"env": "KVCLOUD_SECRET"}
    )
    """Master secret from which tenant keys are derived. Set it in production."""

    tenant: str = field(default="default", metadata={"env": "KVCLOUD_TENANT"})
    """Tenant used when a call does not name one."""

    codec: str = field(default="raw", metadata={"env": "KVCLOUD_CODEC"})
    """Codec for new segments: raw, zstd or lz4 (all lossless)."""

    segment_version: int = field(default=3, metadata={"env": "KVCLOUD_SEGMENT_VERSION"})
    """Object format written: 3 (the default: addressed by its header, which holds a BLAKE3
    digest per layer, so each layer is verified as it arrives), 2 (BLAKE3 of the whole
    object) or 1 (SHA-256). All three are always read. Set the newest format every worker of
    the fleet reads while older releases still run (docs/OPERATIONS.md, "Upgrading the
    object format")."""

    ttl_seconds: int = field(default=7 * 24 * 3600, metadata={"env": "KVCLOUD_TTL_SECONDS"})
    """Index entry lifetime after its last hit (sliding)."""

    max_connections: int = field(default=16, metadata={"env": "KVCLOUD_MAX_CONNECTIONS"})
    """Parallel transfers per client, and the HTTP connection pool size that matches it."""

    connect_timeout: float = field(default=2.0, metadata={"env": "KVCLOUD_CONNECT_TIMEOUT"})
    """Seconds to establish a connection to the store or index."""

    read_timeout: float = field(default=5.0, metadata={"env": "KVCLOUD_READ_TIMEOUT"})
    """Seconds to wait for a response once connected (the same default as the vLLM
    connector's: one variable, one meaning)."""

    fsync: bool = field(default=False, metadata={"env": "KVCLOUD_FSYNC"})
    """file:// store: fsync objects and their directory before an entry is written."""

    encrypt_tenants: str = field(default="", metadata={"env": "KVCLOUD_ENCRYPT_TENANTS"})
    """Tenants whose segments are encrypted at rest (AES-256-GCM, keys derived from the
    secret): a comma list, ``*`` for every tenant, empty for none. Their pulls accept only
    encrypted objects. A list or set of names is accepted too and normalised to the string."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> KVCloudConfig:
        values = env_values(cls, env)
        if "secret" in values:
            values["secret"] = values["secret"].encode("utf-8")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def __post_init__(self) -> None:
        if isinstance(self.secret, str):
            self.secret = self.secret.encode("utf-8")
        if not self.secret:
            raise ConfigError("KVCLOUD_SECRET must not be empty")
        if self.codec not in ("raw", "zstd", "lz4"):
            raise ConfigError(f"KVCLOUD_CODEC: unknown codec {self.codec!r}")
        if self.segment_version not in (1, 2, 3):
            raise ConfigError(
                f"KVCLOUD_SEGMENT_VERSION: {self.segment_version} is not 1, 2 or 3 (object formats)"
            )
        if self.ttl_seconds <= 0:
            raise ConfigError("KVCLOUD_TTL_SECONDS must be positive")
        if self.max_connections <= 0:
            raise ConfigError("KVCLOUD_MAX_CONNECTIONS must be positive")
        raw_names: Any = self.encrypt_tenants
        names = raw_names.split(",") if isinstance(raw_names, str) else raw_names
        if not isinstance(names, list | tuple | set | frozenset) or not all(
            isinstance(n, str) for n in names
        ):
            raise ConfigError("KVCLOUD_ENCRYPT_TENANTS: a comma list of tenant names, or *")
        cleaned = sorted({n.strip() for n in names if n.strip()})
        # "*" means everyone; a list that also names tenants is the same thing
        self.encrypt_tenants = "*" if "*" in cleaned else ",".join(cleaned)

    def encrypts(self, tenant: str) -> bool:
        """Whether ``tenant``'s segments are encrypted at rest."""
        # parsed from the (normalised) string each time, so assigning the field later works
        if not tenant:
            return False
        names = {n.strip() for n in self.encrypt_tenants.split(",")}
        return "*" in names or tenant in names

    @property
    def insecure_secret(self) -> bool:
        return self.secret == INSECURE_DEFAULT_SECRET

    def open_store(self) -> ObjectStore:
        """The object store this configuration names, with its pool size and timeouts."""
        from .stores import open_store  # the stores import this module

        return open_store(
            self.store,
            max_workers=self.max_connections,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            fsync=self.fsync,
        )

    def open_index(self) -> Index:
        """The index this configuration names, with its TTL and timeouts."""
        from .indexes import open_index

        return open_index(
            self.index,
            ttl_seconds=self.ttl_seconds,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
        )
