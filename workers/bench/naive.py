"""The naive baseline of ``bench ttft``: what a user writes by hand, one ``torch.save`` blob per
chunk, sequential GETs, one index round trip per chunk."""

from __future__ import annotations

import contextlib
import hashlib
import io
import sqlite3
from pathlib import Path

import numpy as np
import torch

from .backends import Backend


class NaiveStore:
    """What a user writes by hand: torch.save per chunk, one blocking call at a time."""

    def __init__(self, b: Backend) -> None:
        self.b = b
        if b.name == "file":
            assert b.naive_dir is not None
            self.root = Path(b.naive_dir)
            self.root.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.root / "index.db")
            self.db.execute("CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, path TEXT)")
        else:
            import boto3
            import redis

            self.s3 = boto3.client("s3", endpoint_url=b.s3_endpoint, region_name="us-east-1")
            with contextlib.suppress(Exception):
                self.s3.create_bucket(Bucket=b.bucket)
            self.r = redis.Redis.from_url(b.index)

    @staticmethod
    def key(tokens: list[int]) -> str:
        return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()

    def put(self, tokens: list[int], page: torch.Tensor) -> None:
        buf = io.BytesIO()
        torch.save(page.clone(), buf)
        k = self.key(tokens)
        if self.b.name == "file":
            path = self.root / k
            path.write_bytes(buf.getvalue())
            self.db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (k, str(path)))
            self.db.commit()
        else:
            self.s3.put_object(
                Bucket=self.b.bucket, Key=f"{self.b.prefix}/{k}", Body=buf.getvalue()
            )
            self.r.set(f"naive:{k}", f"{self.b.prefix}/{k}")

    def get(self, tokens: list[int]) -> torch.Tensor | None:
        k = self.key(tokens)
        if self.b.name == "file":
            row = self.db.execute("SELECT path FROM kv WHERE k = ?", (k,)).fetchone()
            if row is None:
                return None
            data = Path(row[0]).read_bytes()
        else:
            obj = self.r.get(f"naive:{k}")
            if obj is None:
                return None
            data = self.s3.get_object(Bucket=self.b.bucket, Key=obj.decode())["Body"].read()
        return torch.load(io.BytesIO(data))
