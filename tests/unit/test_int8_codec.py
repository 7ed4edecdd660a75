"""The int8 KV codec (kvcloud/quant.py): error bounds against a float64 reference, bf16 rounding
against torch, hostile payloads, and the namespace rule that lossy and exact KV never mix."""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from kvcloud import KVCloud, derive_tenant_key
from kvcloud.crypto import derive_data_key
from kvcloud.errors import (
    CodecError,
    ConfigError,
    HeaderMismatchError,
    LayoutError,
    MalformedHeaderError,
)
from kvcloud.indexes.base import IndexEntry
from kvcloud.namespace import Namespace, chunk_fingerprints
from kvcloud.segment import MAGIC, decode_segment, encode_segment, read_segment_into

TENANT = derive_tenant_key(b"secret", "t")


def _ns(dtype: str = "float16", quant: str = "int8", chunk: int = 16) -> Namespace:
    return Namespace(
        model="m", revision="r", num_layers=3, num_kv_heads=2, head_dim=32, dtype=dtype,
        chunk_tokens=chunk, quant=quant,
    )  # fmt: skip


def _kv(ns: Namespace, n: int, seed: int = 0) -> np.ndarray:
    """KV-like values: per-head magnitudes spread over orders (as attention sinks make them)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-2, 2, size=(ns.num_layers, 2, n, ns.num_kv_heads, 1))
    x = torch.from_numpy(rng.standard_normal(ns.kv_shape(n)) * mag)
    t = x.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        ns.dtype
    ])  # fmt: skip
    if ns.dtype == "bfloat16":
        return t.view(torch.uint16).numpy().view("<u2")
    return t.numpy()


def _f64(arr: np.ndarray, dtype: str) -> np.ndarray:
    t = torch.from_numpy(arr.view(np.int16) if dtype == "bfloat16" else arr)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.to(torch.float64).numpy()


def _encode(ns: Namespace, kv: np.ndarray, **kw):
    fps = chunk_fingerprints(ns, np.arange(ns.chunk_tokens), TENANT)
    return encode_segment(ns, fps[0], ns.digest, kv, codec="int8", **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_within_half_a_step_and_matches_a_reference(dtype: str) -> None:
    ns = _ns(dtype)
    kv = _kv(ns, 16)
    seg = _encode(ns, kv)
    elems = kv.size
    assert seg.header.codec == "int8" and seg.header.raw_len == kv.nbytes
    assert len(seg.data) - seg.header.payload_len < 300  # the header
    assert seg.header.payload_len == elems + 4 * elems // ns.head_dim  # 1 B + a scale per head
    out = decode_segment(bytes(seg.data), digest=seg.digest, ns=ns).array
    streamed = np.zeros_like(out)
    read_segment_into(io.BytesIO(bytes(seg.data)), streamed, digest=seg.digest, ns=ns)
    assert streamed.tobytes() == out.tobytes()

    # an independent float64 reference: absmax over head_dim, 127 levels. Every decoded value
    # lies within half a level of the original (plus the cast to the cache dtype), and the
    # head's largest value decodes to itself
    x = _f64(kv, dtype)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    got = _f64(out, dtype)
    slack = 0.5 * scale + np.abs(x) * {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert (np.abs(got - x) <= slack + 1e-30).all()
    top = np.abs(x).argmax(axis=-1)[..., None]
    rel = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert np.allclose(np.take_along_axis(got, top, -1), np.take_along_axis(x, top, -1), rtol=rel)

    if dtype == "bfloat16":
        # the float32 → bfloat16 rounding is torch's, bit for bit
        n_scales = elems // ns.head_dim
        payload = memoryview(bytes(seg.data))[-seg.header.payload_len :]
        s = np.frombuffer(payload, "<f4", count=n_scales).reshape(*kv.shape[:4], 1)
        qq = np.frombuffer(payload, "i1", offset=4 * n_scales).reshape(kv.shape)
        ref = torch.from_numpy(qq.astype("<f4") * s).to(torch.bfloat16).view(torch.uint16)
        assert ref.numpy().tobytes() == out.tobytes()


def test_zero_heads_and_encrypted_round_trip() -> None:
    ns = _ns("float16")
    kv = _kv(ns, 16)
    kv[1, 0, 3, 1, :] = 0  # an all-zero head: scale 0, decodes to exact zeros
    key = derive_data_key(b"k", "t")
    seg = _encode(ns, kv, key=key)
    assert seg.header.encrypted
    out = decode_segment(bytes(seg.data), digest=seg.digest, ns=ns, key=key).array
    assert (out[1, 0, 3, 1] == 0).all()
    plain = decode_segment(bytes(_encode(ns, kv).data), ns=ns).array
    assert plain.tobytes() == out.tobytes()


def test_codec_and_namespace_must_agree() -> None:
    lossless, lossy = _ns(quant=""), _ns()
    kv = _kv(lossy, 16)
    fps = chunk_fingerprints(lossless, np.arange(16), TENANT)
    with pytest.raises(ConfigError, match="lossy"):
        encode_segment(lossless, fps[0], lossless.digest, kv, codec="int8")
    with pytest.raises(ConfigError, match="lossy"):
        encode_segment(lossy, fps[0], lossy.digest, kv, codec="raw")
    with pytest.raises(ConfigError, match="float cache dtype"):
        _ns("int8")
    with pytest.raises(ConfigError, match="unknown KV codec"):
        _ns(quant="int4")
    bad = kv.copy()
    bad[0, 0, 0, 0, 0] = np.inf
    with pytest.raises(LayoutError, match="non-finite"):
        _encode(lossy, bad)


def test_lossless_namespace_ids_are_unchanged() -> None:
    """Adding the codec field must not move any existing (lossless) namespace."""
    ns = _ns(quant="")
    canonical = msgpack.packb(
        ["kvcloud-namespace", 1, "m", "r", 3, 2, 32, "float16", 16, ""]
    )  # the list as every earlier release hashed it
    assert ns.digest == hashlib.blake2b(canonical, digest_size=32, person=b"kvc-ns-v1").digest()
    assert _ns().id != ns.id


def _forge(seg, edit) -> bytes:
    """Rewrite an object's payload with ``edit(payload: bytearray)`` (header kept)."""
    data = bytearray(seg.data)
    start = len(data) - seg.header.payload_len
    payload = bytearray(data[start:])
    edit(payload)
    return bytes(data[:start] + payload)


@pytest.mark.parametrize(
    "dtype,scale,match",
    [
        ("float16", -1.0, "negative or non-finite"),
        ("float16", float("nan"), "negative or non-finite"),
        ("float16", 1000.0, "overflow float16"),  # 127 × 1000 > 65504
        ("bfloat16", 3e36, "overflow bfloat16"),
        ("float32", float("inf"), "negative or non-finite"),
    ],
)
def test_hostile_scales_are_a_codec_error(dtype: str, scale: float, match: str) -> None:
    ns = _ns(dtype)
    seg = _encode(ns, _kv(ns, 16))
    data = _forge(seg, lambda p: struct.pack_into("<f", p, 4 * 5, scale))
    with pytest.raises(CodecError, match=match):
        decode_segment(data, ns=ns)
    out = np.zeros(ns.kv_shape(16), ns.dtype_info.storage)
    with pytest.raises(CodecError, match=match):
        read_segment_into(io.BytesIO(data), out, ns=ns)


def test_wrong_payload_length_is_malformed() -> None:
    ns = _ns()
    seg = _encode(ns, _kv(ns, 16))
    data = bytes(seg.data)
    (hlen,) = struct.unpack_from("<I", data, 4)
    h = msgpack.unpackb(data[8 : 8 + hlen], raw=False)
    h["payload_len"] -= 1
    hb = msgpack.packb(h, use_bin_type=True)
    forged = MAGIC + struct.pack("<I", len(hb)) + hb + data[8 + hlen : -1]
    with pytest.raises(MalformedHeaderError, match="int8 payload length"):
        decode_segment(forged, ns=ns)


def test_an_int8_namespace_is_never_served_to_an_exact_worker(tmp_path: Path) -> None:
    """Same model, same tokens: the 8-bit namespace's pushes are invisible to a lossless
    lookup, and an int8 object slipped under a lossless entry (or the reverse) is refused,
    never decoded into the cache."""
    lossy, exact = _ns("bfloat16"), _ns("bfloat16", quant="")
    toks = np.arange(2 * 16) + 7
    kv = _kv(lossy, 32)
    with KVCloud.open(store=f"file://{tmp_path / 'o'}", index=f"sqlite://{tmp_path / 'i'}") as k:
        res = k.push(lossy, toks, kv)
        assert res.pushed == 2
        assert k.lookup(exact, toks).tokens == 0
        m = k.lookup(lossy, toks)
        assert m.tokens == 32
        approx = k.pull(m)
        assert approx.tobytes() != kv.tobytes()  # lossy, as promised
        a, b = _f64(approx, "bfloat16"), _f64(kv, "bfloat16")
        step = np.abs(b).max(axis=-1, keepdims=True) / 127
        assert (np.abs(a - b) <= 0.5 * step + 8e-3 * np.abs(b)).all()

        # hostile index: the exact namespace's entry names the int8 object
        efps = k.fingerprints(exact, toks)
        obj = k.store.get(res.keys[0])
        k.index.register(exact.id, efps[0].hex(), IndexEntry(res.keys[0], 16, len(obj), 0.0))
        m = k.lookup(exact, toks)
        assert m.tokens == 16
        got = k.pull_detailed(m)
        assert got.chunks == 0 and got.failures  # refused, counted as a failure
        # and the reverse: an exact object under the int8 namespace
        ex = k.push(exact, toks[16:], kv[:, :, 16:])  # a different prefix, lossless
        assert ex.pushed == 1
        with pytest.raises(HeaderMismatchError):
            decode_segment(k.store.get(ex.keys[0]), ns=lossy)
