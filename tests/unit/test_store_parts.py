"""Objects written as parts: encode_segment_parts and ``put`` of a tuple of buffers store
exactly the bytes encode_segment and a one-buffer put would."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcloud.crypto import derive_data_key
from kvcloud.errors import ConfigError, StoreError
from kvcloud.segment import encode_segment, encode_segment_parts
from kvcloud.stores import FileStore
from kvcloud.stores import file as file_store
from tests.helpers import make_kv, make_ns

FP, PARENT = bytes(range(32)), bytes(range(32, 64))


def _joined(parts: tuple[Any, ...]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
@pytest.mark.parametrize("encrypted", [False, True])
@pytest.mark.parametrize("shape", ["page", "strided", "partial"])
def test_parts_are_the_encoded_object(
    version: int, codec: str, encrypted: bool, shape: str
) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    long = make_kv(ns, 3 * c, seed=5)
    kv = {
        "page": np.ascontiguousarray(long[:, :, :c]),
        "strided": long[:, :, c : 2 * c],  # a chunk sliced out of a longer array
        "partial": long[:, :, 2 * c : 2 * c + 5],
    }[shape]
    key = derive_data_key(b"secret", "acme") if encrypted else None
    seg = encode_segment(ns, FP, PARENT, kv, codec, key=key, version=version)
    parts = encode_segment_parts(ns, FP, PARENT, kv, codec, key=key, version=version)
    assert _joined(parts.parts) == bytes(seg.data)
    assert (parts.digest, parts.header, parts.size) == (seg.digest, seg.header, len(seg.data))
    assert parts.key() == seg.key()


def test_a_raw_page_is_not_copied() -> None:
    ns = make_ns()
    kv = make_kv(ns, ns.chunk_tokens)
    parts = encode_segment_parts(ns, FP, PARENT, kv).parts
    assert len(parts) == 2 and np.shares_memory(np.frombuffer(parts[1], np.uint8), kv)


def test_parts_refuse_what_encode_segment_refuses() -> None:
    ns = make_ns()
    kv = make_kv(ns, ns.chunk_tokens)
    with pytest.raises(ConfigError):
        encode_segment_parts(ns, FP, PARENT, kv, version=7)
    with pytest.raises(ConfigError):
        encode_segment_parts(make_ns(quant="int8"), FP, PARENT, kv)


def test_file_put_of_parts_stores_their_concatenation(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    parts = (b"KVC1", bytearray(b"head"), memoryview(b""), memoryview(np.arange(9, dtype="<u2")))
    assert store.put("ns/ab/obj", parts) is True
    assert store.get("ns/ab/obj") == _joined(parts)
    assert store.put("ns/ab/obj", [b"whatever"]) is False  # still create-only


def test_file_put_finishes_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """writev may write less than asked (large objects, signals): the rest must follow."""
    real = os.writev

    def stingy(fd: int, buffers: Any) -> int:
        # at most 5 bytes per call, split inside a buffer more often than not
        first = memoryview(buffers[0]).cast("B")[:5]
        return real(fd, [first])

    monkeypatch.setattr(file_store.os, "writev", stingy)
    store = FileStore(tmp_path)
    data = (b"abc", b"defghijk", bytes(range(23)))
    store.put("ns/ab/short", data)
    assert (tmp_path / "ns" / "ab" / "short").read_bytes() == _joined(data)


def test_file_put_creates_missing_directories_once(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    assert store.put("ns/ab/one", b"1") and store.put("ns/ab/two", b"2")
    assert store.put("other/cd/three", (b"3",))
    assert sorted(i.key for i in store.list()) == ["ns/ab/one", "ns/ab/two", "other/cd/three"]


def test_file_put_into_a_file_is_a_store_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "ns").write_bytes(b"not a directory")
    with pytest.raises(StoreError):
        store.put("ns/ab/obj", b"x")


def test_s3_put_of_parts_stores_their_concatenation() -> None:
    from moto import mock_aws

    from kvcloud.stores.s3 import S3Store
    from kvcloud.stores.s3_config import S3Config

    parts = (b"KVC1", memoryview(np.arange(7, dtype="<u2")), bytearray(b"tail"))
    with mock_aws(), S3Store(S3Config(bucket="bkt", create_bucket=True)) as store:
        assert store.put("ns/ab/obj", parts) is True
        assert store.get("ns/ab/obj") == _joined(parts)
