from __future__ import annotations

import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcloud import CorruptObjectError, KVCloudError, LayoutError, derive_tenant_key
from kvcloud.crypto import derive_data_key
from kvcloud.errors import (
    BadMagicError,
    CodecError,
    DecryptionError,
    DigestMismatchError,
    HeaderMismatchError,
    MalformedHeaderError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from kvcloud.namespace import chunk_fingerprints
from kvcloud.segment import (
    CODECS,
    LOSSY_CODECS,
    MAGIC,
    content_digest,
    decode_segment,
    digest_from_key,
    encode_segment,
    encode_segment_parts,
    encoded_size,
    read_header,
    read_segment_into,
)
from tests.helpers import DTYPE_CASES, make_kv, make_ns, make_tokens, readdress, same_bits

KEY = derive_tenant_key(b"secret", "t")
# codecs a lossless namespace encodes with (int8 has its own tests: test_int8_codec.py)
LOSSLESS = tuple(c for c in CODECS if c not in LOSSY_CODECS)


def _seg(dtype: str = "float16", codec: str = "raw", n: int = 16):
    ns = make_ns(dtype)
    toks = make_tokens(32)
    fps = chunk_fingerprints(ns, toks, KEY)
    kv = make_kv(ns, 32)
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 16 : 16 + n], codec=codec)
    return ns, fps, kv, seg


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("codec", LOSSLESS)
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
    digest = content_digest(data)
    tracemalloc.start()
    try:
        decode_segment(data, digest=digest, ns=ns, **kw)
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
@pytest.mark.parametrize("codec", LOSSLESS)
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
    # with a content address to check, damage is a digest mismatch, as decode_segment
    # reports it for the same bytes; without one, the structural error
    for damaged in (data[:-3], data + b"\0", data[:6]):
        with pytest.raises(DigestMismatchError):
            _stream_decode(damaged, ns, digest=seg.digest)
        with pytest.raises(DigestMismatchError):
            decode_segment(damaged, digest=seg.digest, ns=ns)
        with pytest.raises(TruncatedObjectError):
            _stream_decode(damaged, ns)
    for pos in range(0, len(data), max(1, len(data) // 61)):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptObjectError):
            _stream_decode(bytes(bad), ns, digest=seg.digest, fp=fps[1], parent=fps[0], n_tokens=16)


def test_stream_decode_into_a_slice_of_a_longer_array_reads_block_by_block() -> None:
    """A chunk's slice of one array (pull(out=...)) is filled block by block straight from
    the stream: bit-exact, and nothing near the object's size is allocated."""
    import io

    ns = make_ns(chunk_tokens=256, num_layers=4, num_kv_heads=4, head_dim=64)
    toks = make_tokens(512)
    fps = chunk_fingerprints(ns, toks, KEY)
    kv = make_kv(ns, 512)
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 256:])
    big = np.zeros(ns.kv_shape(1024), dtype=ns.dtype_info.storage)
    dest = big[:, :, 256:512]
    assert not dest.flags.c_contiguous
    stream = io.BytesIO(bytes(seg.data))
    tracemalloc.start()
    try:
        _, size = read_segment_into(
            stream, dest, digest=seg.digest, ns=ns, fp=fps[1], parent=fps[0]
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == len(seg.data) and same_bits(dest, kv[:, :, 256:])
    assert not big[:, :, :256].any() and not big[:, :, 512:].any()  # nothing outside the slice
    assert peak < ns.chunk_bytes // 8, peak
    # a flipped payload bit in that path is a digest mismatch, the rest of the array untouched
    bad = bytearray(seg.data)
    bad[-100] ^= 1
    with pytest.raises(DigestMismatchError):
        read_segment_into(io.BytesIO(bytes(bad)), dest, digest=seg.digest, ns=ns)
    assert not big[:, :, :256].any()


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
    digest = content_digest(data)
    tracemalloc.start()
    try:
        read_segment_into(io.BytesIO(data), out, digest=digest, ns=ns)
    except KVCloudError as exc:
        assert isinstance(exc, CorruptObjectError | LayoutError), type(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(data) + 2 * ns.chunk_bytes + (1 << 20), peak


# --- encrypted segments (issue 5) ---------------------------------------------------------------

_DKEY = derive_data_key(b"secret", "t")
_OTHER_DKEY = derive_data_key(b"secret", "u")


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("codec", LOSSLESS)
def test_encrypted_round_trip_bit_exact_and_deterministic(dtype: str, codec: str) -> None:
    import io

    ns = make_ns(dtype)
    toks = make_tokens(32)
    fps = chunk_fingerprints(ns, toks, KEY)
    kv = make_kv(ns, 32)
    strided = kv[:, :, 16:32]  # a slice of a longer array, as push() hands it over
    seg = encode_segment(ns, fps[1], fps[0], strided, codec=codec, key=_DKEY)
    again = encode_segment(ns, fps[1], fps[0], np.ascontiguousarray(strided), codec, key=_DKEY)
    assert bytes(seg.data) == bytes(again.data)  # deterministic: equal chunks dedup
    assert seg.header.encrypted and seg.header.key_id == _DKEY.key_id
    assert seg.header.to_dict()["encryption"]["nonce"] == seg.header.nonce.hex()
    assert bytes(seg.data) != bytes(encode_segment(ns, fps[1], fps[0], strided, codec).data)
    want = np.ascontiguousarray(strided)
    dec = decode_segment(
        seg.data, digest=seg.digest, ns=ns, fp=fps[1], parent=fps[0], n_tokens=16, key=_DKEY
    )
    assert same_bits(dec.array, want)
    out = np.empty(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    header, size = read_segment_into(
        io.BytesIO(bytes(seg.data)), out, digest=seg.digest, ns=ns, key=_DKEY
    )
    assert size == len(seg.data) and header.encrypted and same_bits(out, want)
    # a strided destination takes the buffered path
    big = np.empty(ns.kv_shape(32), dtype=ns.dtype_info.storage)
    read_segment_into(io.BytesIO(bytes(seg.data)), big[:, :, 16:], ns=ns, key=_DKEY)
    assert same_bits(big[:, :, 16:], want)


def test_encrypted_needs_the_right_key_and_policy() -> None:
    import io

    ns, fps, kv, plain = _seg()
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 16:32], key=_DKEY)
    out = np.empty(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    for key in (None, _OTHER_DKEY):
        with pytest.raises(DecryptionError):
            decode_segment(seg.data, ns=ns, key=key)
        with pytest.raises(DecryptionError):
            read_segment_into(io.BytesIO(bytes(seg.data)), out, ns=ns, key=key)
    # a plaintext object is fine unless the tenant requires encryption
    decode_segment(plain.data, ns=ns, key=_DKEY)
    with pytest.raises(DecryptionError):
        decode_segment(plain.data, ns=ns, key=_DKEY, require_encryption=True)
    with pytest.raises(DecryptionError):
        read_segment_into(io.BytesIO(bytes(plain.data)), out, ns=ns, require_encryption=True)


def test_encrypted_stream_decode_rejects_damage() -> None:
    """Each flipped byte, in place (digest mismatch) and re-addressed (the tag's job)."""
    import io

    ns, fps, kv, _ = _seg()
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 16:32], key=_DKEY)
    data = bytes(seg.data)
    _, offset = read_header(data)
    out = np.empty(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    for pos in range(0, len(data), max(1, len(data) // 73)):
        bad = bytearray(data)
        bad[pos] ^= 0x20
        with pytest.raises(CorruptObjectError) as in_place:
            read_segment_into(io.BytesIO(bytes(bad)), out, digest=seg.digest, ns=ns, key=_DKEY)
        if pos >= offset:  # the payload parses whatever it holds: the digest catches it first
            assert isinstance(in_place.value, DigestMismatchError)
        # re-addressed: for a payload byte the forger also rewrites the digest table
        forged, digest = readdress(bad) if pos >= offset else (bytes(bad), content_digest(bad))
        with pytest.raises(CorruptObjectError) as exc:
            read_segment_into(io.BytesIO(forged), out, digest=digest, ns=ns, key=_DKEY)
        if pos >= offset:
            assert isinstance(exc.value, DecryptionError)


def _encrypted_header(codec: str) -> tuple[dict, bytes]:
    ns, fps, kv, _ = _seg(codec=codec)
    seg = encode_segment(ns, fps[1], fps[0], kv[:, :, 16:32], codec=codec, key=_DKEY)
    data = bytes(seg.data)
    hlen = struct.unpack_from("<I", data, 4)[0]
    return msgpack.unpackb(data[8 : 8 + hlen]), data[8 + hlen :]


_VALID_ENCRYPTED = {codec: _encrypted_header(codec) for codec in LOSSLESS}


@st.composite
def hostile_encrypted(draw: st.DrawFn) -> bytes:
    """A valid encrypted object whose header (mostly its ``enc`` map) is then garbled."""
    header, payload = _VALID_ENCRYPTED[draw(st.sampled_from(LOSSLESS))]
    h = {k: (dict(v) if isinstance(v, dict) else v) for k, v in header.items()}
    enc = h["enc"]
    choice = draw(st.integers(0, 3))
    if choice == 0:  # the enc map replaced by anything at all
        h["enc"] = draw(_values)
    elif choice == 1:  # fields of the enc map garbled, dropped or added
        for key in draw(st.lists(st.sampled_from(["alg", "kid", "nonce"]), max_size=3)):
            if draw(st.booleans()):
                enc[key] = draw(
                    st.one_of(
                        _values,
                        st.sampled_from(["aes-256-gcm", "none", "AES-256-GCM", ""]),
                        st.binary(min_size=11, max_size=13),
                        st.text(min_size=60, max_size=70),
                    )
                )
            else:
                enc.pop(key, None)
        for k, v in draw(st.dictionaries(st.text(max_size=6), _values, max_size=2)).items():
            enc[k] = v
    elif choice == 2:  # a well-formed map that lies: another nonce or key id
        enc["nonce"] = draw(st.binary(min_size=12, max_size=12))  # the tag's job
        if draw(st.booleans()):
            enc["kid"] = draw(st.text(min_size=1, max_size=64))
    # lengths that disagree with the tag, sometimes wildly
    if draw(st.booleans()):
        h["payload_len"] = draw(
            st.sampled_from([0, 15, 16, 17, h["raw_len"], h["raw_len"] + 16, 2**31, -1])
        )
    body = draw(st.sampled_from(["keep", "random", "cut"]))
    if body == "random":
        payload = draw(st.binary(max_size=1024))
    elif body == "cut":
        payload = payload[: draw(st.integers(0, len(payload)))]
    return _frame(h, payload)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hostile_encrypted(), require=st.booleans())
def test_hostile_encrypted_headers_only_typed_errors_bounded_memory(
    data: bytes, require: bool
) -> None:
    import io

    ns = make_ns()
    _assert_only_typed_and_bounded(data, key=_DKEY, require_encryption=require)
    out = np.empty(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    tracemalloc.start()
    try:
        read_segment_into(
            io.BytesIO(data),
            out,
            digest=content_digest(data),
            ns=ns,
            key=_DKEY,
            require_encryption=require,
        )
    except KVCloudError as exc:
        assert isinstance(exc, CorruptObjectError | LayoutError), type(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * len(data) + 2 * ns.chunk_bytes + (1 << 20), peak


@pytest.mark.parametrize("dtype", [*DTYPE_CASES, "float8_e4m3fn"])
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("encrypted", [False, True])
def test_encoded_size_is_the_encoders_length(dtype: str, version: int, encrypted: bool) -> None:
    """``encoded_size`` (what sizing tools use, without encoding) is the length of the object
    the encoder writes, whole or in parts, full chunk or short, plain or encrypted."""
    ns = make_ns(dtype, num_layers=3, num_kv_heads=4)
    key = _DKEY if encrypted else None
    fp = bytes(range(32))
    for heads, n in ((None, 16), ((0, 2), 16), ((2, 4), 16), (None, 5)):
        width = ns.num_kv_heads if heads is None else heads[1] - heads[0]
        kv = make_kv(ns, n)[:, :, :, :width]
        seg = encode_segment(ns, fp, ns.digest, kv, key=key, version=version, heads=heads)
        parts = encode_segment_parts(ns, fp, ns.digest, kv, key=key, version=version, heads=heads)
        size = encoded_size(ns, n, key=key, version=version, heads=heads)
        assert size == len(seg.data) == parts.size, (heads, n)
