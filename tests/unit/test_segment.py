from __future__ import annotations

import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcloud import CorruptObjectError, KVCloudError, LayoutError, derive_tenant_key
from kvcloud.errors import (
    BadMagicError,
    CodecError,
    DigestMismatchError,
    HeaderMismatchError,
    MalformedHeaderError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from kvcloud.namespace import chunk_fingerprints
from kvcloud.segment import (
    CODECS,
    MAGIC,
    content_digest,
    decode_segment,
    digest_from_key,
    encode_segment,
    read_header,
    read_segment_into,
)
from tests.helpers import DTYPE_CASES, make_kv, make_ns, make_tokens, same_bits

KEY = derive_tenant_key(b"secret", "t")


def _seg(dtype: str = "float16", codec: str = "raw", n: int = 16):
    ns = make_ns(dtype)
    toks = make_tokens(32)
    fps = chunk_fingerprints(ns, toks, KEY)
    kv = make_kv(ns, 32)
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 16 : 16 + n], codec=codec)
    return ns, fps, kv, seg


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_bit_exact(dtype: str, codec: str) -> None:
    ns, fps, kv, seg = _seg(dtype, codec)
    assert seg.digest == content_digest(seg.data)
    assert seg.key() == f"{ns.id}/{seg.digest[:2]}/{seg.digest}"
    dec = decode_segment(seg.data, digest=seg.digest, ns=ns, fp=fps[1], parent=fps[0], n_tokens=16)
    assert same_bits(dec.array, np.ascontiguousarray(kv[:, :, 16:32]))
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    decode_segment(seg.data, digest=seg.digest, ns=ns, out=out)
    assert same_bits(out, np.ascontiguousarray(kv[:, :, 16:32]))


def test_same_content_same_key_and_partial_segment() -> None:
    a = _seg()[3]
    b = _seg()[3]
    assert a.digest == b.digest and bytes(a.data) == bytes(b.data)
    ns, _fps, kv, part = _seg(n=5)
    assert part.header.n_tokens == 5
    dec = decode_segment(part.data, digest=part.digest, ns=ns, n_tokens=5)
    assert same_bits(dec.array, np.ascontiguousarray(kv[:, :, 16:21]))


def test_every_flipped_byte_is_detected_by_the_digest() -> None:
    ns, fps, _, seg = _seg()
    data = bytes(seg.data)
    for pos in range(0, len(data), max(1, len(data) // 97)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(DigestMismatchError):
            decode_segment(bad, digest=seg.digest, ns=ns, fp=fps[1])


def test_structural_errors_are_typed() -> None:
    _ns, _fps, _, seg = _seg()
    data = bytes(seg.data)
    with pytest.raises(TruncatedObjectError):
        read_header(data[:5])
    with pytest.raises(BadMagicError):
        read_header(b"NOPE" + data[4:])
    with pytest.raises(TruncatedObjectError):
        read_header(data[:-1])
    with pytest.raises(TruncatedObjectError):
        read_header(data + b"x")
    hlen = struct.unpack_from("<I", data, 4)[0]
    with pytest.raises(TruncatedObjectError):
        read_header(data[:4] + struct.pack("<I", len(data)) + data[8:])
    with pytest.raises(MalformedHeaderError):
        read_header(data[:4] + struct.pack("<I", 1 << 30) + data[8:])
    header = msgpack.unpackb(data[8 : 8 + hlen])
    header["v"] = 99
    h2 = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(UnsupportedVersionError):
        read_header(MAGIC + struct.pack("<I", len(h2)) + h2 + data[8 + hlen :])


def test_header_mismatch_is_detected() -> None:
    ns, fps, _, seg = _seg()
    with pytest.raises(HeaderMismatchError):
        decode_segment(seg.data, ns=ns, fp=fps[0])
    with pytest.raises(HeaderMismatchError):
        decode_segment(seg.data, ns=ns, parent=fps[1])
    with pytest.raises(HeaderMismatchError):
        decode_segment(seg.data, ns=make_ns(revision="other"))
    with pytest.raises(HeaderMismatchError):
        decode_segment(seg.data, ns=ns, n_tokens=8)


def test_encode_rejects_wrong_layout() -> None:
    ns = make_ns()
    fp = b"\0" * 32
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, fp, np.zeros((3, 2, 16, 2, 8), np.float16))
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, fp, np.zeros((2, 2, 16, 2, 8), np.float32))
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, fp, np.zeros((2, 2, 17, 2, 8), np.float16))


def _frame(header: object, payload: bytes, declared_len: int | None = None) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    n = len(h) if declared_len is None else declared_len
    return MAGIC + struct.pack("<I", n & 0xFFFFFFFF) + h + payload


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.binary(max_size=40),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@st.composite
def hostile_headers(draw: st.DrawFn) -> dict:
    """Start from a valid header and corrupt some fields with arbitrary values."""
    ns = make_ns()
    h = {
        "v": 1,
        "ns": ns.id,
        "fp": b"\1" * 32,
        "parent": b"\0" * 32,
        "n": 16,
        "layout": [2, 2, 8],
        "dtype": "float16",
        "codec": draw(st.sampled_from(CODECS)),
        "raw_len": 16 * ns.bytes_per_token,
        "payload_len": 16 * ns.bytes_per_token,
        "enc": {"alg": "none"},
    }
    for key in draw(st.lists(st.sampled_from(sorted(h)), max_size=4, unique=True)):
        if draw(st.booleans()):
            h[key] = draw(_values)
        else:
            del h[key]
    for k, v in draw(st.dictionaries(st.text(max_size=6), _values, max_size=2)).items():
        h[k] = v
    # lying sizes are the dangerous case: make them large often
    if draw(st.booleans()):
        h["raw_len"] = draw(st.sampled_from([0, 1, 2**31, 2**40, 2**63, -1]))
        h["n"] = draw(st.sampled_from([0, 1, 16, 2**20, 2**31]))
    return h


def _assert_only_typed_and_bounded(data: bytes, **kw: object) -> None:
    ns = make_ns()
    tracemalloc.start()
    try:
        decode_segment(data, digest=content_digest(data), ns=ns, **kw)
    except KVCloudError as exc:
        assert isinstance(exc, CorruptObjectError | LayoutError), type(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # never more than a few copies of the input plus one chunk of KV
    assert peak < 4 * len(data) + 2 * ns.chunk_bytes + (1 << 20), peak


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2048))
def test_random_bytes_only_typed_errors(data: bytes) -> None:
    _assert_only_typed_and_bounded(data)
    _assert_only_typed_and_bounded(MAGIC + data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=hostile_headers(),
    payload=st.binary(max_size=1024),
    lie=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
def test_hostile_headers_only_typed_errors_bounded_memory(
    header: dict, payload: bytes, lie: int | None
) -> None:
    _assert_only_typed_and_bounded(_frame(header, payload, lie))


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_decompression_bomb_is_refused(codec: str) -> None:
    """A small object that claims (or decompresses to) far more than one chunk."""
    import lz4.block
    import zstandard

    ns = make_ns()
    big = bytes(64 << 20)
    payload = (
        zstandard.ZstdCompressor().compress(big)
        if codec == "zstd"
        else lz4.block.compress(big, store_size=False)
    )
    n = (64 << 20) // ns.bytes_per_token
    header = {
        "v": 1,
        "ns": ns.id,
        "fp": b"\1" * 32,
        "parent": b"\0" * 32,
        "n": n,
        "layout": [2, 2, 8],
        "dtype": "float16",
        "codec": codec,
        "raw_len": n * ns.bytes_per_token,
        "payload_len": len(payload),
        "enc": {"alg": "none"},
    }
    data = _frame(header, payload)
    tracemalloc.start()
    with pytest.raises(CorruptObjectError):
        decode_segment(data, digest=content_digest(data), ns=ns)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20
    # honest size but a payload that is not what it claims
    header["n"] = 16
    header["raw_len"] = 16 * ns.bytes_per_token
    data = _frame(header, payload)
    with pytest.raises(CodecError):
        decode_segment(data, ns=ns)


def test_digest_from_key() -> None:
    assert digest_from_key("ns/ab/abcdef") == "abcdef"


# --- the streaming decoder (what pulls use to land in KV pages) -------------------------------


def _stream_decode(data: bytes, ns, **kw):  # type: ignore[no-untyped-def]
    import io

    out = np.empty(ns.kv_shape(kw.pop("n", 16)), dtype=ns.dtype_info.storage)
    header, size = read_segment_into(io.BytesIO(data), out, ns=ns, **kw)
    return header, size, out


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("codec", CODECS)
def test_stream_decode_bit_exact(dtype: str, codec: str) -> None:
    ns, fps, kv, seg = _seg(dtype, codec)
    header, size, out = _stream_decode(
        bytes(seg.data), ns, digest=seg.digest, fp=fps[1], parent=fps[0], n_tokens=16
    )
    assert size == len(seg.data) and header.codec == codec
    assert same_bits(out, np.ascontiguousarray(kv[:, :, 16:32]))


def test_stream_decode_rejects_damage() -> None:
    ns, fps, _, seg = _seg()
    data = bytes(seg.data)
    with pytest.raises(TruncatedObjectError):
        _stream_decode(data[:-3], ns, digest=seg.digest)
    with pytest.raises(TruncatedObjectError):
        _stream_decode(data + b"\0", ns, digest=seg.digest)
    with pytest.raises(TruncatedObjectError):
        _stream_decode(data[:6], ns)
    for pos in range(0, len(data), max(1, len(data) // 61)):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptObjectError):
            _stream_decode(bytes(bad), ns, digest=seg.digest, fp=fps[1], parent=fps[0], n_tokens=16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=hostile_headers(),
    payload=st.binary(max_size=1024),
    lie=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
def test_stream_decode_hostile_only_typed_errors(
    header: dict, payload: bytes, lie: int | None
) -> None:
    import io

    ns = make_ns()
    data = _frame(header, payload, lie)
    out = np.empty(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    tracemalloc.start()
    try:
        read_segment_into(io.BytesIO(data), out, digest=content_digest(data), ns=ns)
    except KVCloudError as exc:
        assert isinstance(exc, CorruptObjectError | LayoutError), type(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(data) + 2 * ns.chunk_bytes + (1 << 20), peak
