"""The two digest formats of segment objects: version 2 (written now, addressed by BLAKE3)
and version 1 (written by older builds, addressed by SHA-256). Digests are recomputed here
with the reference libraries (hashlib, blake3), not kvcloud's helpers."""

from __future__ import annotations

import hashlib
import io
import struct

import blake3
import msgpack
import numpy as np
import pytest

from kvcloud import derive_tenant_key
from kvcloud.crypto import derive_data_key
from kvcloud.errors import (
    CorruptObjectError,
    DigestMismatchError,
    HeaderMismatchError,
    UnsupportedVersionError,
)
from kvcloud.namespace import chunk_fingerprints
from kvcloud.segment import (
    MAGIC,
    decode_segment,
    digest_alg,
    digest_matches,
    encode_segment,
    read_segment_into,
)
from tests.helpers import make_kv, make_ns, make_tokens, same_bits

TENANT = derive_tenant_key(b"secret", "t")


def _encode(version: int, codec: str = "raw", encrypted: bool = False):
    ns = make_ns()
    fps = chunk_fingerprints(ns, make_tokens(32), TENANT)
    kv = make_kv(ns, 16, seed=version)
    key = derive_data_key(b"k", "t") if encrypted else None
    seg = encode_segment(ns, fps[1], fps[0], kv, codec=codec, key=key, version=version)
    return ns, kv, seg, key


def _stream(data: bytes, digest: str, ns, key=None) -> np.ndarray:
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    read_segment_into(io.BytesIO(data), out, digest=digest, ns=ns, key=key)
    return out


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("encrypted", [False, True])
def test_new_objects_are_blake3_addressed_and_old_ones_still_read(
    codec: str, encrypted: bool
) -> None:
    ns, kv, new, key = _encode(2, codec, encrypted)
    assert new.header.version == 2
    assert new.digest == blake3.blake3(bytes(new.data)).hexdigest() + ".b3"
    assert new.key() == f"{ns.id}/{new.digest[:2]}/{new.digest}"
    assert digest_alg(new.digest) == "blake3"

    _, kv1, old, _ = _encode(1, codec, encrypted)
    assert old.header.version == 1
    assert old.digest == hashlib.sha256(bytes(old.data)).hexdigest()
    assert digest_alg(old.digest) == "sha256"

    for seg, ref in ((new, kv), (old, kv1)):
        data = bytes(seg.data)
        assert digest_matches(data, seg.digest)
        dec = decode_segment(data, digest=seg.digest, ns=ns, key=key)
        assert same_bits(dec.array, ref)
        assert same_bits(_stream(data, seg.digest, ns, key), ref)


def test_every_flipped_bit_of_a_blake3_object_is_caught() -> None:
    ns, _, seg, _ = _encode(2)
    data = bytes(seg.data)
    for pos in range(0, len(data), max(1, len(data) // 61)):
        bad = bytearray(data)
        bad[pos] ^= 0x04
        assert not digest_matches(bad, seg.digest)
        with pytest.raises(DigestMismatchError):
            decode_segment(bad, digest=seg.digest, ns=ns)
        # the stream may fail earlier (a broken magic or header), always as corrupt
        with pytest.raises(CorruptObjectError):
            _stream(bytes(bad), seg.digest, ns)


@pytest.mark.parametrize("version,other", [(1, "blake3"), (2, "sha256")])
def test_an_object_under_the_other_algorithms_address_is_refused(version: int, other: str) -> None:
    """Hostile: valid bytes re-addressed by the other digest. The digest matches the bytes,
    but the header's version names a different algorithm than the key: never guessed."""
    ns, _, seg, _ = _encode(version)
    data = bytes(seg.data)
    if other == "blake3":
        forged = blake3.blake3(data).hexdigest() + ".b3"
    else:
        forged = hashlib.sha256(data).hexdigest()
    assert digest_matches(data, forged)
    with pytest.raises(HeaderMismatchError, match="addressed by"):
        decode_segment(data, digest=forged, ns=ns)
    with pytest.raises(HeaderMismatchError, match="addressed by"):
        _stream(data, forged, ns)


@pytest.mark.parametrize(
    "digest",
    [
        "",
        "ab",
        "0" * 63,
        "0" * 64 + ".B3",
        "0" * 64 + ".b2",
        "0" * 64 + ".b3.b3",
        "sha256:" + "0" * 64,
        "../" + "0" * 61,
        "G" * 64,
    ],
)
def test_malformed_digests_are_a_typed_error(digest: str) -> None:
    ns, _, seg, _ = _encode(2)
    with pytest.raises(DigestMismatchError):
        digest_alg(digest)
    with pytest.raises(DigestMismatchError):
        decode_segment(bytes(seg.data), digest=digest, ns=ns)
    with pytest.raises(DigestMismatchError):
        _stream(bytes(seg.data), digest, ns)


def test_unknown_version_and_truncated_blake3_object() -> None:
    ns, _, seg, _ = _encode(2)
    data = bytes(seg.data)
    (hlen,) = struct.unpack_from("<I", data, 4)
    h = msgpack.unpackb(data[8 : 8 + hlen], raw=False)
    h["v"] = 4  # a version this build does not know, under a key form it does
    hb = msgpack.packb(h, use_bin_type=True)
    v4 = MAGIC + struct.pack("<I", len(hb)) + hb + data[8 + hlen :]
    d4 = blake3.blake3(v4).hexdigest() + ".b3"
    with pytest.raises(UnsupportedVersionError):
        decode_segment(v4, digest=d4, ns=ns)
    with pytest.raises(UnsupportedVersionError):
        _stream(v4, d4, ns)
    short = data[:-5]
    # both paths report damage to an addressed object the same way
    with pytest.raises(DigestMismatchError):
        decode_segment(short, digest=seg.digest, ns=ns)
    with pytest.raises(DigestMismatchError):
        _stream(short, seg.digest, ns)


def test_large_buffers_hash_the_same_on_several_threads() -> None:
    """Buffers over the threading threshold go through blake3's multithreaded path; the
    digest must not depend on it."""
    data = np.random.default_rng(3).integers(0, 256, size=40 << 20, dtype=np.uint8).tobytes()
    from kvcloud.segment import content_digest

    assert content_digest(data) == blake3.blake3(data).hexdigest() + ".b3"
    assert content_digest(data, "sha256") == hashlib.sha256(data).hexdigest()


def test_segment_version_setting_picks_the_written_format(tmp_path) -> None:
    """KVCLOUD_SEGMENT_VERSION=1 keeps writing what earlier releases read (rolling upgrade);
    both formats are read either way; anything else is a clear ConfigError."""
    from kvcloud import KVCloud, KVCloudConfig
    from kvcloud.errors import ConfigError
    from kvcloud.segment import read_header

    ns = make_ns()
    toks = make_tokens(2 * ns.chunk_tokens, seed=5)
    arr = make_kv(ns, len(toks), seed=5)
    urls = {"store": f"file://{tmp_path / 'o'}", "index": f"sqlite://{tmp_path / 'i.db'}"}
    old = KVCloudConfig.from_env(env={"KVCLOUD_SEGMENT_VERSION": "1"}, **urls)
    with KVCloud.open(config=old) as kv:
        keys = kv.push(ns, toks[: ns.chunk_tokens], arr[:, :, : ns.chunk_tokens]).keys
        assert read_header(kv.store.get(keys[0]))[0].version == 1
    with KVCloud.open(config=KVCloudConfig.from_env(env={}, **urls)) as kv:
        keys = kv.push(ns, toks, arr).keys
        assert [read_header(kv.store.get(k))[0].version for k in keys] == [1, 3]
        assert same_bits(kv.pull(kv.lookup(ns, toks)), arr)
    v2 = KVCloudConfig.from_env(env={"KVCLOUD_SEGMENT_VERSION": "2"}, **urls)
    with KVCloud.open(config=v2) as kv:
        keys = kv.push(ns, np.concatenate([toks, toks]), np.concatenate([arr, arr], axis=2)).keys
        assert [read_header(kv.store.get(k))[0].version for k in keys] == [1, 3, 2, 2]
    with pytest.raises(ConfigError, match="KVCLOUD_SEGMENT_VERSION"):
        KVCloudConfig.from_env(env={"KVCLOUD_SEGMENT_VERSION": "4"}, **urls)
