"""``s3://`` store configuration: the URL's typed options and the botocore session clients
are built from.

boto3 is an optional extra (``pip install kvcloud[s3]``). This module imports without it, so
``S3Config`` can be parsed and validated anywhere; only building a session needs it.
Credentials always come from the normal AWS chain (env vars, profile, instance role) and never
travel in the store URL, so the URL can be logged as is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from ..errors import ConfigError, StoreError
from ..urls import env_bool, redact_url, split_url
from . import s3_writes
from .base import validate_key

if TYPE_CHECKING:
    from botocore.config import Config as BotocoreConfig

INSTALL_HINT = "the s3:// store needs boto3: pip install kvcloud[s3]"

# Query keys that would mean someone is trying to pass credentials in the URL. Refused with a
# message that never repeats the value.
_CREDENTIAL_QUERY_KEYS = {
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "access_key",
    "access_key_id",
    "secret",
    "secret_key",
    "secret_access_key",
    "session_token",
    "token",
    "password",
    "key",
}


@dataclass
class S3Config:
    """Typed options of an ``s3://bucket/prefix?option=value`` store URL.

    Precedence, highest first: keyword overrides to ``from_url``, URL query options, the
    environment variables named on each field, the defaults here.
    """

    bucket: str
    """Bucket name. URL: ``s3://<bucket>/…``."""

    prefix: str = ""
    """Key prefix inside the bucket, without slashes at either end. URL: ``s3://bucket/<prefix>``."""

    endpoint_url: str | None = field(
        default=None,
        metadata={"query": "endpoint_url", "env": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")},
    )
    """S3 endpoint for MinIO & co, e.g. ``http://minio:9000``; None means AWS itself.
    URL: ``?endpoint_url=…``. Env: ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``."""

    region: str = field(
        default="us-east-1",
        metadata={"query": "region", "env": ("AWS_REGION", "AWS_DEFAULT_REGION")},
    )
    """Signing region. URL: ``?region=…``. Env: ``AWS_REGION``, then ``AWS_DEFAULT_REGION``."""

    addressing_style: str = field(default="path", metadata={"query": "addressing_style"})
    """``path`` (``host/bucket/key``, works everywhere incl. MinIO), ``virtual`` or ``auto``.
    URL: ``?addressing_style=…``."""

    max_connections: int = field(default=16, metadata={"query": "max_connections"})
    """HTTP connection pool size, and the size of the store's transfer thread pool: one
    connection per thread, so parallel GETs never wait for a connection. URL:
    ``?max_connections=…``; ``open_store(max_workers=…)`` sets it when the URL does not."""

    connect_timeout: float = field(default=2.0, metadata={"query": "connect_timeout"})
    """Seconds to establish a connection. URL: ``?connect_timeout=…``."""

    read_timeout: float = field(default=10.0, metadata={"query": "read_timeout"})
    """Seconds to wait for data once connected. URL: ``?read_timeout=…``."""

    max_attempts: int = field(
        default=5, metadata={"query": "max_attempts", "env": ("AWS_MAX_ATTEMPTS",)}
    )
    """Total attempts per request, the first included (botocore's ``total_max_attempts``),
    with backoff on throttling, 5xx and connection errors. URL: ``?max_attempts=…``.
    Env: ``AWS_MAX_ATTEMPTS``."""

    conditional_put: str = field(default="auto", metadata={"query": "conditional_put"})
    """How ``put`` avoids rewriting an existing object and tells that it existed: ``on`` sends
    ``If-None-Match: *`` and trusts the server's 412; ``off`` asks with a HEAD first; ``auto``
    finds out on the first write whether the server honours the header (AWS, MinIO, Ceph) or
    ignores or refuses it (rclone, Swift s3api) and does the right one. A 501 to the header
    always falls back to HEAD-first (see ``s3_writes``). Booleans mean on and off.
    URL: ``?conditional_put=auto|on|off``."""

    sign_payload: bool = field(default=False, metadata={"query": "sign_payload"})
    """SigV4-sign the body (``x-amz-content-sha256`` of the payload) instead of sending
    ``UNSIGNED-PAYLOAD``. Off by default: every kvcloud object is content-addressed and its
    SHA-256 is verified on every read, so signing would hash each PUT a second time for no
    extra integrity. Headers are always signed. URL: ``?sign_payload=…``."""

    create_bucket: bool = field(default=False, metadata={"query": "create_bucket"})
    """Create the bucket when the store is opened if it does not exist (tests, demos).
    URL: ``?create_bucket=…``."""

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket or "@" in self.bucket:
            raise ConfigError(f"invalid S3 bucket name {self.bucket!r}")
        self.prefix = (self.prefix or "").strip("/")
        if self.prefix:
            try:
                validate_key(self.prefix)
            except StoreError:
                raise ConfigError(f"invalid S3 key prefix {self.prefix[:80]!r}") from None
        if self.endpoint_url:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    f"endpoint_url {redact_url(self.endpoint_url)!r} must be http(s)://host[:port]"
                )
            if "@" in parts.netloc:
                # Credentials in the endpoint would end up in logs and botocore's messages.
                raise ConfigError(
                    f"endpoint_url {redact_url(self.endpoint_url)!r} contains credentials; "
                    "use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile instead"
                )
        else:
            self.endpoint_url = None
        if self.addressing_style not in ("path", "virtual", "auto"):
            raise ConfigError(
                f"addressing_style must be path, virtual or auto, not {self.addressing_style!r}"
            )
        if not self.region:
            raise ConfigError("S3 region must not be empty")
        try:
            self.conditional_put = s3_writes.parse_mode(self.conditional_put)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("max_connections", "max_attempts"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"S3 {name} must be at least 1")
        for name in ("connect_timeout", "read_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"S3 {name} must be positive")

    @classmethod
    def from_url(
        cls, url: str, *, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> S3Config:
        """Parse ``s3://bucket/prefix?opt=value``. ``None`` overrides are ignored."""
        scheme, netloc, path, query = split_url(url)
        if scheme != "s3":
            raise ConfigError(f"not an s3:// URL: {redact_url(url)!r}")
        if "@" in netloc:
            raise ConfigError(
                f"{redact_url(url)!r}: credentials do not belong in the store URL; "
                "use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
            )
        if not netloc:
            raise ConfigError(f"{redact_url(url)!r} names no bucket (s3://bucket/prefix)")
        env = os.environ if env is None else env

        by_query = {f.metadata["query"]: f for f in fields(cls) if "query" in f.metadata}
        values: dict[str, Any] = {"bucket": netloc, "prefix": path}
        for f in fields(cls):
            for var in f.metadata.get("env", ()):
                if env.get(var):
                    values[f.name] = _convert(f.name, env[var], f"env {var}")
                    break
        for k, v in query.items():
            if k.lower() in _CREDENTIAL_QUERY_KEYS:
                raise ConfigError(
                    f"{redact_url(url)!r}: credentials do not belong in the store URL ({k}=…); "
                    "use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
                )
            if k not in by_query:
                known_options = ", ".join(sorted(by_query))
                raise ConfigError(
                    f"{redact_url(url)!r}: unknown option {k!r}; known: {known_options}"
                )
            values[by_query[k].name] = _convert(by_query[k].name, v, f"URL option {k}")
        known = {f.name for f in fields(cls)}
        for k, v in overrides.items():
            if k not in known:
                raise ConfigError(f"unknown S3 option {k!r}; known: {', '.join(sorted(known))}")
            if v is not None:
                values[k] = v
        return cls(**values)

    @property
    def url(self) -> str:
        """A canonical, credential-free URL for this configuration, safe to log."""
        query: dict[str, str] = {}
        if self.endpoint_url:
            query["endpoint_url"] = redact_url(self.endpoint_url)
        query["region"] = self.region
        path = f"/{self.prefix}" if self.prefix else ""
        return f"s3://{self.bucket}{path}?{urlencode(query, safe='/:')}"

    def botocore_config(self) -> BotocoreConfig:
        """The client settings this configuration implies."""
        from botocore.config import Config

        return Config(
            region_name=self.region,
            s3={
                "addressing_style": self.addressing_style,
                "payload_signing_enabled": bool(self.sign_payload),
            },
            # total_max_attempts counts the first try; botocore's "max_attempts" key would
            # count only retries, which is not what the field (or AWS_MAX_ATTEMPTS) means.
            retries={"total_max_attempts": int(self.max_attempts), "mode": "standard"},
            connect_timeout=float(self.connect_timeout),
            read_timeout=float(self.read_timeout),
            max_pool_connections=int(self.max_connections),
            # Objects carry their own digest; the newer default (CRC on every PUT, validated
            # on GET) costs CPU and is rejected or mishandled by several S3-compatible servers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "max_connections": int,
    "max_attempts": int,
    "connect_timeout": float,
    "read_timeout": float,
    "conditional_put": s3_writes.parse_mode,
    "create_bucket": env_bool,
    "sign_payload": env_bool,
}


def _convert(name: str, raw: str, source: str) -> Any:
    try:
        return _CONVERTERS.get(name, str)(raw)
    except ValueError as exc:
        raise ConfigError(f"S3 {name} from {source}: {exc}") from None


_loader_lock = threading.Lock()
_shared_loader: Any = None


def new_botocore_session() -> Any:
    """A fresh session (so credentials are resolved anew) that reuses parsed API models.

    Loading the S3 model costs ~0.1 s per session; stores are opened often enough (one per
    worker, one per test) for that to matter, and the parsed models never change.
    """
    global _shared_loader
    try:
        import boto3  # noqa: F401 - the extra to install; we drive botocore directly
        import botocore.session
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    session = botocore.session.get_session()
    with _loader_lock:
        if _shared_loader is None:
            _shared_loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _shared_loader)
    return session


__all__ = ["INSTALL_HINT", "S3Config"]
