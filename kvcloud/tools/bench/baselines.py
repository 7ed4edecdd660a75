"""The baselines: what a user writes by hand to move the same bytes (boto3 or plain files)."""

from __future__ import annotations

from collections.abc import Sequence

from ...stores.base import ObjectStore
from ...stores.file import FileStore
from ...stores.s3 import S3Store
from .layout import BenchError


class Plain:
    """What a user writes by hand: put/get whole objects by key, nothing else."""

    method_put = ""
    method_get = ""

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def prepare(self, keys: Sequence[str]) -> None:
        """Anything a plain client would have done before the transfer (mkdir)."""

    def close(self) -> None:
        pass


class _PlainS3(Plain):
    method_put = "boto3 put_object"
    method_get = "boto3 get_object"

    def __init__(self, store: S3Store) -> None:
        import boto3
        from botocore.config import Config

        cfg = store.config
        self.bucket = cfg.bucket
        self.prefix = f"{cfg.prefix}/" if cfg.prefix else ""
        # The same endpoint, region, addressing, pool size and checksum policy as kvcloud's
        # client, so the comparison is about kvcloud's own work and not client settings.
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region,
            config=Config(
                region_name=cfg.region,
                s3={"addressing_style": cfg.addressing_style},
                max_pool_connections=int(cfg.max_connections),
                connect_timeout=float(cfg.connect_timeout),
                read_timeout=float(cfg.read_timeout),
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def close(self) -> None:
        self.client.close()


class _PlainFile(Plain):
    method_put = "file open().write"
    method_get = "file open().read"

    def __init__(self, store: FileStore) -> None:
        self.root = store.root

    def prepare(self, keys: Sequence[str]) -> None:
        for d in {(self.root / k).parent for k in keys}:
            d.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        with open(self.root / key, "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with open(self.root / key, "rb") as f:
            return f.read()


def plain_client(store: ObjectStore) -> Plain:
    if isinstance(store, S3Store):
        return _PlainS3(store)
    if isinstance(store, FileStore):
        return _PlainFile(store)
    raise BenchError(f"no plain baseline for a {type(store).__name__}; use s3:// or file://")
