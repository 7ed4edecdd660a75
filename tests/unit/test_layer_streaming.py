"""Format 3: the key addresses the header, the header's table addresses each layer, so a
reader verifies the header before reading any KV and hands layer l over while layer l + 1 is
still unread; a damaged layer stops the read at that layer, and nothing unverified is ever
handed over."""

from __future__ import annotations

import io
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvcloud import KVCloud
from kvcloud.crypto import derive_data_key
from kvcloud.errors import DigestMismatchError, HeaderMismatchError, MalformedHeaderError
from kvcloud.segment import (
    MAGIC,
    content_digest,
    decode_segment,
    digest_alg,
    digest_matches,
    encode_segment,
    encode_segment_parts,
    piece_bounds,
    read_header,
    read_segment_into,
)
from kvcloud.segment.header import PREFIX as _PREFIX
from tests.helpers import make_kv, make_ns, make_tokens, same_bits

FP, PARENT = b"\x11" * 32, b"\x22" * 32


class _Tracked(io.BytesIO):
    """A stream that remembers how many bytes it has handed out."""

    @property
    def consumed(self) -> int:
        return self.tell()


def _encoded(layers: int = 4, **kw: object):  # type: ignore[no-untyped-def]
    ns = make_ns(num_layers=layers, chunk_tokens=16)
    kv = make_kv(ns, 16, seed=3)
    return ns, kv, encode_segment(ns, FP, PARENT, kv, **kw)  # type: ignore[arg-type]


def test_the_key_addresses_the_header_and_the_table_each_layer() -> None:
    ns, kv, seg = _encoded()
    data = bytes(seg.data)
    header, offset = read_header(data)
    assert header.version == 3 and digest_alg(seg.digest) == "blake3-layers"
    assert seg.digest.endswith(".b3l") and seg.digest == content_digest(data)
    # the key is the BLAKE3 of prefix and header alone; the table holds one digest a layer
    import blake3

    assert seg.digest == blake3.blake3(data[:offset]).hexdigest() + ".b3l"
    assert len(header.pieces) == ns.num_layers
    for (a, b), want in zip(piece_bounds(header), header.pieces, strict=True):
        assert b - a == header.raw_len // ns.num_layers
        assert blake3.blake3(data[offset + a : offset + b]).digest() == want
    assert digest_matches(data, seg.digest)
    # the scattered-buffer encoder writes exactly the same object
    parts = encode_segment_parts(ns, FP, PARENT, kv)
    assert parts.digest == seg.digest and b"".join(bytes(p) for p in parts.parts) == data


def test_each_layer_is_handed_over_before_the_next_is_read() -> None:
    ns, kv, seg = _encoded()
    data = bytes(seg.data)
    _, offset = read_header(data)
    per_layer = (len(data) - offset) // ns.num_layers
    reader = _Tracked(data)
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    seen: list[tuple[int, int, bool]] = []

    def on_layer(layer: int) -> None:
        # layer l is in place and verified; nothing of layer l + 1 has been read yet
        seen.append((layer, reader.consumed, same_bits(out[layer], kv[layer])))

    read_segment_into(reader, out, digest=seg.digest, ns=ns, on_layer=on_layer)
    assert [layer for layer, _, _ in seen] == list(range(ns.num_layers))
    assert [at for _, at, _ in seen] == [offset + (i + 1) * per_layer for i in range(4)]
    assert all(ok for _, _, ok in seen)
    assert same_bits(out, kv)


def test_a_damaged_layer_stops_the_read_there() -> None:
    ns, kv, seg = _encoded()
    data = bytearray(seg.data)
    _, offset = read_header(bytes(data))
    per_layer = (len(data) - offset) // ns.num_layers
    data[offset + 2 * per_layer + 5] ^= 0x04  # in layer 2
    reader = _Tracked(bytes(data))
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    handed: list[int] = []
    with pytest.raises(DigestMismatchError, match="layer 2"):
        read_segment_into(reader, out, digest=seg.digest, ns=ns, on_layer=handed.append)
    assert handed == [0, 1] and same_bits(out[:2], kv[:2])
    assert reader.consumed == offset + 3 * per_layer  # layer 3 was never read
    assert not digest_matches(bytes(data), seg.digest)
    with pytest.raises(DigestMismatchError):
        decode_segment(bytes(data), digest=seg.digest, ns=ns)


def test_a_changed_header_is_refused_before_any_kv_is_read() -> None:
    ns, _, seg = _encoded()
    data = bytearray(seg.data)
    _, offset = read_header(bytes(data))
    data[offset - 3] ^= 0x01  # inside the digest table, at the header's end
    reader = _Tracked(bytes(data))
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    handed: list[int] = []
    with pytest.raises(DigestMismatchError, match="header"):
        read_segment_into(reader, out, digest=seg.digest, ns=ns, on_layer=handed.append)
    assert handed == [] and reader.consumed == offset and not out.any()


@pytest.mark.parametrize("damage", ["short", "long", "magic"])
def test_bytes_missing_or_added_are_a_digest_mismatch(damage: str) -> None:
    ns, _, seg = _encoded()
    data = bytes(seg.data)
    bad = {"short": data[:-7], "long": data + b"\0", "magic": b"KVC0" + data[4:]}[damage]
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    with pytest.raises(DigestMismatchError):
        read_segment_into(io.BytesIO(bad), out, digest=seg.digest, ns=ns)
    with pytest.raises(DigestMismatchError):
        decode_segment(bad, digest=seg.digest, ns=ns)


def test_a_token_slice_of_a_longer_array_streams_layer_by_layer() -> None:
    ns, kv, seg = _encoded()
    big = np.zeros((*ns.kv_shape(48)[:2], 48, *ns.kv_shape(48)[3:]), ns.dtype_info.storage)
    handed: list[int] = []
    read_segment_into(
        io.BytesIO(bytes(seg.data)), big[:, :, 16:32], digest=seg.digest, ns=ns,
        on_layer=handed.append,
    )  # fmt: skip
    assert handed == [0, 1, 2, 3] and same_bits(big[:, :, 16:32], kv)
    assert not big[:, :, :16].any() and not big[:, :, 32:].any()


@pytest.mark.parametrize("kind", ["zstd", "lz4", "encrypted"])
def test_other_payloads_have_one_digest_and_hand_every_layer_over_at_the_end(kind: str) -> None:
    key = derive_data_key(b"s" * 32, "acme") if kind == "encrypted" else None
    ns, kv, seg = _encoded(codec="raw" if key else kind, key=key)
    header, _ = read_header(bytes(seg.data))
    assert header.version == 3 and len(header.pieces) == 1
    reader = _Tracked(bytes(seg.data))
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    at: list[int] = []
    read_segment_into(
        reader,
        out,
        digest=seg.digest,
        ns=ns,
        key=key,
        on_layer=lambda _: at.append(reader.consumed),
    )
    assert at == [len(seg.data)] * ns.num_layers and same_bits(out, kv)
    # one changed payload byte, re-addressed by nobody: the table catches it
    bad = bytearray(seg.data)
    bad[-20] ^= 0x10
    with pytest.raises(DigestMismatchError):
        read_segment_into(io.BytesIO(bytes(bad)), out, digest=seg.digest, ns=ns, key=key)
    assert not digest_matches(bytes(bad), seg.digest)


def _reheader(data: bytes, change) -> bytes:  # type: ignore[no-untyped-def]
    hlen = _PREFIX.unpack_from(data)[1]
    h = msgpack.unpackb(data[_PREFIX.size : _PREFIX.size + hlen], raw=False)
    change(h)
    hb = msgpack.packb(h, use_bin_type=True)
    return _PREFIX.pack(MAGIC, len(hb)) + hb + data[_PREFIX.size + hlen :]


def test_a_table_of_the_wrong_size_is_malformed() -> None:
    ns, _, seg = _encoded()
    data = bytes(seg.data)
    short = _reheader(data, lambda h: h.__setitem__("ld", h["ld"][:-1]))
    with pytest.raises(MalformedHeaderError, match="piece digests"):
        decode_segment(short, digest=content_digest(short), ns=ns)
    out = np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage)
    with pytest.raises(MalformedHeaderError, match="piece digests"):
        read_segment_into(io.BytesIO(short), out, digest=content_digest(short), ns=ns)
    # a format 2 header has no table to trust: one there is malformed
    v2 = encode_segment(ns, FP, PARENT, make_kv(ns, 16, seed=3), version=2)
    tabled = _reheader(bytes(v2.data), lambda h: h.__setitem__("ld", [bytes(32)]))
    with pytest.raises(MalformedHeaderError):
        decode_segment(tabled, digest=content_digest(tabled, "blake3"), ns=ns)
    # a format 3 object under a format 2 address (or the reverse) is the wrong object
    with pytest.raises(HeaderMismatchError, match="format version 3"):
        decode_segment(data, digest=content_digest(data, "blake3"), ns=ns)
    with pytest.raises(HeaderMismatchError, match="format version 2"):
        decode_segment(v2.data, digest=content_digest(v2.data, "blake3-layers"), ns=ns)


def test_pull_into_hands_each_chunk_layer_over_once(tmp_path: Path) -> None:
    ns = make_ns(num_layers=3, chunk_tokens=16)
    toks, arr = make_tokens(48, seed=9), make_kv(ns, 48, seed=9)
    with KVCloud.open(store=f"file://{tmp_path / 'o'}", index=f"sqlite://{tmp_path / 'i'}") as kv:
        kv.push(ns, toks, arr)
        dests = [np.zeros(ns.kv_shape(16), dtype=ns.dtype_info.storage) for _ in range(3)]
        handed: list[tuple[int, int, bool]] = []

        def on_layer(i: int, layer: int) -> None:
            c = ns.chunk_tokens
            handed.append(
                (i, layer, same_bits(dests[i][layer], arr[layer, :, i * c : (i + 1) * c]))
            )

        res = kv.pull_into(kv.lookup(ns, toks), dests, on_layer=on_layer)
    assert res.chunks == 3
    assert sorted((i, layer) for i, layer, _ in handed) == [
        (i, j) for i in range(3) for j in range(3)
    ]
    assert all(ok for _, _, ok in handed)
    for i in range(3):  # each chunk's layers in order
        assert [layer for j, layer, _ in handed if j == i] == [0, 1, 2]


def test_redis_entries_store_a_format_3_key_in_33_bytes() -> None:
    """The Redis index packs standard keys as a form byte and the raw digest; a format 3 key
    (``.b3l``) is one of them, and unpacks to itself."""
    from kvcloud.indexes.redis_layout import _unpack_key, pack_key

    ns = make_ns()
    _, _, seg = _encoded()
    for digest in (seg.digest, seg.digest[:-1], seg.digest[:-4]):  # .b3l, .b3, SHA-256
        key = f"{ns.id}/{digest[:2]}/{digest}"
        packed = pack_key(ns.id, key)
        assert len(packed) == 33 and _unpack_key(ns.id, packed) == key
