"""``s3://`` object store on boto3: AWS S3, MinIO, or anything else that speaks S3.

boto3 is an optional extra (``pip install kvcloud[s3]``). This module imports without it, so
``S3Config`` can be parsed and validated anywhere; only constructing an ``S3Store`` needs it.
Credentials always come from the normal AWS chain (env vars, profile, instance role) and never
travel in the store URL, so the URL can be logged as is.
"""

from __future__ import annotations

import http.client
import io
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from ..errors import ConfigError, ObjectNotFoundError, StoreError, StoreUnavailableError
from ..urls import env_bool, redact_url, split_url
from . import s3_writes
from .base import Buffer, BufferParts, ObjectInfo, ObjectStore, join_parts, validate_key

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

# Server-side conditions that mean "try later", not "you asked for something wrong". boto3's
# standard retry mode already backs off on them; when they survive the retries the store is
# unavailable rather than broken.
_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
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


def _new_botocore_session() -> Any:
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


class S3Store(ObjectStore):
    """Objects at ``s3://bucket/{prefix}/{key}``, through one shared (thread-safe) client."""

    def __init__(self, config: S3Config) -> None:
        session = _new_botocore_session()
        super().__init__(max_workers=config.max_connections)
        self.config = config
        self.url = config.url
        self._key_prefix = f"{config.prefix}/" if config.prefix else ""
        self._where = redact_url(config.endpoint_url) if config.endpoint_url else "AWS S3"
        self._writes: str | None = None  # see conditional_writes()
        self._writes_lock = threading.Lock()
        # botocore clients are thread-safe once built, so the whole pool shares this one.
        self._client = session.create_client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=config.botocore_config(),
        )
        if config.create_bucket:
            try:
                self._ensure_bucket()
            except BaseException:
                self._client.close()  # the caller never gets the store to close
                raise

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> S3Store:
        return cls(S3Config.from_url(url, **overrides))

    # -- helpers ------------------------------------------------------------------------------

    def _s3_key(self, key: str) -> str:
        return self._key_prefix + validate_key(key)

    def _error(self, op: str, key: str, exc: Exception) -> StoreError:
        """Map a boto3 failure to our hierarchy, naming operation, key and endpoint."""
        from botocore.exceptions import (
            ClientError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        what = f"S3 {op} {key!r} at {self.url}"
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            message = err.get("Message") or ""
            if code == "NoSuchBucket":
                return StoreError(
                    f"{what}: bucket {self.config.bucket!r} does not exist at {self._where} "
                    "(create it, or open the store with create_bucket=true)"
                )
            if code in _THROTTLE_CODES or status >= 500:
                return StoreUnavailableError(
                    f"{what}: {code} (HTTP {status}) after {self.config.max_attempts} attempts"
                )
            if code in _CREDENTIAL_CODES or status == 403:
                return StoreError(
                    f"{what}: {code} (HTTP {status}); check the AWS credentials and the "
                    f"permissions on bucket {self.config.bucket!r}"
                )
            return StoreError(f"{what}: {code} (HTTP {status}) {message}".rstrip())
        if isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError):
            return StoreUnavailableError(
                f"{what}: cannot reach {self._where}: {type(exc).__name__}: {exc}; check "
                "that the S3 server runs at that endpoint (host, port, http vs https, "
                "firewall, proxy)"
            )
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StoreError(
                f"{what}: no usable AWS credentials (set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role)"
            )
        return StoreError(f"{what}: {type(exc).__name__}: {exc}")

    def _not_found(self, exc: Any) -> bool:
        """The key is absent (a missing bucket is a configuration error, not a miss)."""
        code, status = self._status(exc)
        return code in ("NoSuchKey", "404", "NotFound") or (
            status == 404 and code != "NoSuchBucket"
        )

    @staticmethod
    def _status(exc: Exception) -> tuple[str, int]:
        response = getattr(exc, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket = self.config.bucket
        try:
            self._client.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            if self._status(exc)[1] != 404:
                raise self._error("head_bucket", bucket, exc) from exc
        except BotoCoreError as exc:
            raise self._error("head_bucket", bucket, exc) from exc
        kwargs: dict[str, Any] = {"Bucket": bucket}
        # us-east-1 is the one region that rejects an explicit LocationConstraint.
        if self.config.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.config.region}
        try:
            self._client.create_bucket(**kwargs)
        except ClientError as exc:
            # Another worker created it between our HEAD and CREATE: that is success.
            if self._status(exc)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error("create_bucket", bucket, exc) from exc
        except BotoCoreError as exc:
            raise self._error("create_bucket", bucket, exc) from exc

    # -- ObjectStore ----------------------------------------------------------------------------

    def put(self, key: str, data: Buffer | BufferParts) -> bool:
        data = join_parts(data)
        if self.conditional_writes() == s3_writes.HONOURED:
            written = self._put(key, data, conditional=True)
            if written is not None:
                return written
            # 501 after all (a proxy or an upgrade in between): HEAD-first from now on
            self._learn(s3_writes.REFUSED)
        if self.head(key) is not None:
            return False
        # Two writers that both saw "absent" write the same bytes (content addressing).
        self._put(key, data, conditional=False)
        return True

    def _put(self, key: str, data: Buffer, *, conditional: bool) -> bool | None:
        """One PUT: True when written, False on 412/409 (it exists), None when the server
        refused the conditional header."""
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        # a file-like view: no copy of the object before it goes on the wire
        body = data if isinstance(data, bytes) else _BufferBody(data)
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Key": s3_key, "Body": body}
        if conditional:
            kwargs["IfNoneMatch"] = "*"
        try:
            self._client.put_object(**kwargs)
        except ClientError as exc:
            code, status = self._status(exc)
            # 412: the object exists. 409: a concurrent conditional PUT of the same key is in
            # flight; content addressing means it carries the same bytes, so "exists" is
            # the right answer (and if that writer fails, the index entry is only a hint).
            if conditional and (
                code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)
            ):
                return False
            if conditional and s3_writes.refused(code, status):
                return None
            raise self._error("put", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("put", key, exc) from exc
        return True

    def conditional_writes(self) -> str:
        """What the server does with ``If-None-Match: *`` (``s3_writes.HONOURED``,
        ``IGNORED`` or ``REFUSED``), or ``OFF`` when configured not to send it. Under
        ``conditional_put=auto`` the first call probes the server (two PUTs and a DELETE of
        a throwaway key), once per process and endpoint; store errors propagate."""
        if self._writes is not None:
            return self._writes
        with self._writes_lock:
            if self._writes is None:
                mode = self.config.conditional_put
                if mode == "off":
                    self._writes = s3_writes.OFF
                elif mode == "on":
                    self._writes = s3_writes.HONOURED
                else:
                    found = s3_writes.remembered(self.config.endpoint_url, self.config.bucket)
                    if found is None:
                        found = s3_writes.probe(
                            lambda k: self._put(k, b"probe", conditional=True), self.delete
                        )
                    self._learn(found)
        assert self._writes is not None
        return self._writes

    def _learn(self, mode: str) -> None:
        self._writes = mode
        s3_writes.remember(self.config.endpoint_url, self.config.bucket, self._where, mode)

    def get(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        try:
            response = self._client.get_object(Bucket=self.config.bucket, Key=s3_key)
            with closing(response["Body"]) as body:
                # StreamingBody.read() checks Content-Length, so a cut-off transfer raises
                # IncompleteReadError instead of returning short data.
                return body.read()
        except ClientError as exc:
            if self._not_found(exc):
                raise ObjectNotFoundError(f"{key!r} not found in {self.url}") from None
            raise self._error("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("get", key, exc) from exc

    def touch(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        try:
            # S3 has no "touch": an in-place copy with replaced metadata is the documented way
            # to give an object a new Last-Modified without sending its bytes again
            self._client.copy_object(
                Bucket=self.config.bucket,
                Key=s3_key,
                CopySource={"Bucket": self.config.bucket, "Key": s3_key},
                MetadataDirective="REPLACE",
                # rclone serve s3 keeps a bare self-copy's new Last-Modified in memory only
                # (its listings and a restart show the old one); it sets the file's mtime
                # from this. Harmless elsewhere: the metadata is never read.
                Metadata={"mtime": f"{time.time():.3f}"},
            )
        except ClientError as exc:
            if self._not_found(exc):
                return False
            raise self._error("touch", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("touch", key, exc) from exc
        return True

    def open_read(self, key: str) -> AbstractContextManager[Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        try:
            response = self._client.get_object(Bucket=self.config.bucket, Key=s3_key)
        except ClientError as exc:
            if self._not_found(exc):
                raise ObjectNotFoundError(f"{key!r} not found in {self.url}") from None
            raise self._error("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("get", key, exc) from exc
        return _BodyReader(response["Body"], self, key)

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        try:
            response = self._client.head_object(Bucket=self.config.bucket, Key=s3_key)
        except ClientError as exc:
            # HEAD responses have no body, so a missing bucket is also a bare 404 here and
            # reads as "absent"; get/put/list report it properly.
            if self._status(exc)[1] == 404:
                return None
            raise self._error("head", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("head", key, exc) from exc
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            last_modified=response["LastModified"].timestamp(),
        )

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        s3_key = self._s3_key(key)
        try:
            # S3 answers 204 for absent keys too, which gives idempotence for free.
            self._client.delete_object(Bucket=self.config.bucket, Key=s3_key)
        except ClientError as exc:
            if self._status(exc)[0] in ("NoSuchKey",):
                return
            raise self._error("delete", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("delete", key, exc) from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        cut = len(self._key_prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        last = None
        try:
            pages = paginator.paginate(Bucket=self.config.bucket, Prefix=self._key_prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    # rclone serve s3 can list a key twice right after concurrent PUTs of it;
                    # listings are sorted, so the copies are neighbours
                    if obj["Key"] == last:
                        continue
                    last = obj["Key"]
                    yield ObjectInfo(
                        key=obj["Key"][cut:],
                        size=int(obj["Size"]),
                        last_modified=obj["LastModified"].timestamp(),
                    )
        except (ClientError, BotoCoreError) as exc:
            raise self._error("list", prefix, exc) from exc

    def close(self) -> None:
        super().close()
        # Drops the pooled connections now instead of whenever the client is collected.
        self._client.close()


__all__ = ["S3Config", "S3Store"]


class _BufferBody(io.RawIOBase):
    """A seekable read-only file over a buffer (botocore sizes and rewinds it for retries)."""

    def __init__(self, data: Buffer) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._mv) - self._pos))
        b[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._mv)


class _BodyReader:
    """A GET body as a stream; transport failures mid-read become StoreUnavailableError, and
    the connection goes back to the pool when the block ends.

    When the body is a plain (not chunked, not content-encoded) HTTP response, reads go
    straight to the socket: urllib3's ``readinto`` reads into a temporary bytes object and
    copies it into the caller's buffer, which costs as much memory traffic as hashing the
    object; ``http.client``'s lands the bytes in place. A transfer that ends before its
    Content-Length is then reported as a broken transfer, exactly as urllib3 would.
    """

    def __init__(self, body: Any, store: S3Store, key: str) -> None:
        self._body = body
        self._store = store
        self._key = key
        self._raw, self._sock = _socket_response(body)
        self._left = self._sock.length if self._sock is not None else 0

    def __enter__(self) -> _BodyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._body.close()

    def _guard(self, fn: Any, arg: Any) -> Any:
        from botocore.exceptions import BotoCoreError

        try:
            return fn(arg)
        except BotoCoreError as exc:
            raise self._store._error("get", self._key, exc) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:  # transport errors
            raise StoreUnavailableError(
                f"get {self._key!r} from {self._store.url} broke off: {exc}"
            ) from exc

    def _advance(self, got: int, wanted: int) -> None:
        if got == 0 and wanted and self._left:
            raise StoreUnavailableError(
                f"get {self._key!r} from {self._store.url} broke off with {self._left} "
                "bytes of the body still to come"
            )
        self._left -= got
        if not self._left:
            # the whole body is in: the connection can serve the next request (urllib3
            # would do this itself had the bytes gone through it)
            self._raw.release_conn()

    def read(self, n: int = -1) -> bytes:
        if self._sock is None:
            return self._guard(self._body.read, None if n < 0 else n)
        if not self._left:
            return b""
        data: bytes = self._guard(self._sock.read, None if n < 0 else n)
        self._advance(len(data), n)
        return data

    def readinto(self, buf: Any) -> int:
        if self._sock is None:
            return self._guard(self._body.readinto, buf)
        if not self._left:
            return 0
        got: int = self._guard(self._sock.readinto, buf) or 0
        self._advance(got, len(buf))
        return got


def _socket_response(body: Any) -> tuple[Any, http.client.HTTPResponse | None]:
    """The urllib3 response under a botocore body and its ``http.client`` response, when
    bytes can be read from the latter as they are: nothing read yet, a known length, no
    chunked or content encoding. (None, None) otherwise, and reads go through botocore."""
    raw = getattr(body, "_raw_stream", None)
    sock = getattr(raw, "_fp", None)
    if (
        not isinstance(sock, http.client.HTTPResponse)
        or sock.chunked
        or sock.length is None
        or getattr(raw, "_fp_bytes_read", None) != 0
        or not callable(getattr(raw, "release_conn", None))
        or raw.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
    ):
        return None, None
    return raw, sock
