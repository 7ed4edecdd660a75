"""``s3://`` object store on boto3: AWS S3, MinIO, or anything else that speaks S3.

This module is the store: its requests and the mapping of botocore's failures to kvcloud's
errors. The URL's options and the botocore session: :mod:`.s3_config`; how a PUT avoids
rewriting an object: :mod:`.s3_writes`; the bodies on the wire: :mod:`.s3_stream`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, closing
from typing import Any

from ..errors import ObjectNotFoundError, StoreError, StoreUnavailableError
from ..urls import redact_url
from . import s3_writes
from .base import Buffer, BufferParts, ObjectInfo, ObjectStore, join_parts, validate_key
from .s3_config import S3Config, new_botocore_session
from .s3_stream import BodyReader, BufferBody

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


class S3Store(ObjectStore):
    """Objects at ``s3://bucket/{prefix}/{key}``, through one shared (thread-safe) client."""

    def __init__(self, config: S3Config) -> None:
        session = new_botocore_session()
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
        body = data if isinstance(data, bytes) else BufferBody(data)
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
        return BodyReader(response["Body"], key, self.url, self._error)

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


__all__ = ["S3Store"]
