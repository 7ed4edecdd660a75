"""A chunk stored in parts by KV-head range (what each tensor-parallel rank of an engine
holds), read back by any head range: the whole chunk (a TP-1 reader, kvcloud's own worker),
one part (a rank of the same TP size), or a range across parts or inside a whole object (a
rank of another TP size). Checked against the array that was stored, on the embedded
backends; verify and gc keep and check every part.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvcloud import KVCloud, Namespace
from kvcloud.errors import HeaderMismatchError, LayoutError, MalformedHeaderError
from kvcloud.indexes.base import IndexEntry
from kvcloud.segment import decode_segment, encode_segment, part_layout, part_record_fp
from kvcloud.tools.gc import gc
from kvcloud.tools.verify import verify

H = 4  # KV heads of the namespace


def make_ns() -> Namespace:
    return Namespace(
        model="parts", revision="r", num_layers=3, num_kv_heads=H, head_dim=8,
        dtype="float16", chunk_tokens=16,
    )  # fmt: skip


@pytest.fixture
def kvc(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    yield c
    c.close()


def stored_in_parts(kvc: KVCloud, ns: Namespace, n_parts: int, chunks: int = 2, **kw):  # type: ignore[no-untyped-def]
    """``chunks`` chunks of random KV, each stored as ``n_parts`` head ranges and registered
    once every part is in; returns the tokens and the whole KV."""
    rng = np.random.default_rng(n_parts)
    tokens = rng.integers(0, 50_000, chunks * ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(len(tokens))).astype(np.float16)
    fps = kvc.fingerprints(ns, tokens)
    parents = [ns.digest, *fps[:-1]]
    w = H // n_parts
    for i, (fp, parent) in enumerate(zip(fps, parents, strict=True)):
        chunk = kv[:, :, i * ns.chunk_tokens : (i + 1) * ns.chunk_tokens]
        ranges = [(j * w, (j + 1) * w) for j in range(n_parts)]
        stored = [
            kvc.store_part(ns, fp, parent, chunk[:, :, :, lo:hi], (lo, hi), **kw)
            for lo, hi in ranges
        ]
        assert kvc.lookup(ns, tokens).chunks == tuple(kvc.lookup(ns, tokens).chunks[:i])
        kvc.register_parts(
            ns, fp, [k for k, _ in stored], ns.chunk_tokens, sum(s for _, s in stored)
        )
    return tokens, kv


def pull_heads(kvc: KVCloud, ns: Namespace, tokens, heads):  # type: ignore[no-untyped-def]
    m = kvc.lookup(ns, tokens)
    lo, hi = heads
    dests = [
        np.zeros((*ns.kv_shape(ns.chunk_tokens)[:3], hi - lo, ns.head_dim), np.float16)
        for _ in m.chunks
    ]
    res = kvc.pull_into(m, dests, heads=heads)
    return res, np.concatenate(dests, axis=2) if dests else None


@pytest.mark.parametrize("n_parts", [2, 4])
def test_parts_read_back_by_any_head_range(kvc: KVCloud, n_parts: int) -> None:
    ns = make_ns()
    tokens, kv = stored_in_parts(kvc, ns, n_parts)
    # the whole chunk: a TP-1 reader, or kvcloud's own worker
    assert np.array_equal(kvc.pull(kvc.lookup(ns, tokens)), kv)
    for heads in [(0, 2), (2, 4), (1, 3), (3, 4), (0, 4)]:
        res, got = pull_heads(kvc, ns, tokens, heads)
        assert res.chunks == 2 and not res.failures, heads
        assert np.array_equal(got, kv[:, :, :, heads[0] : heads[1]]), heads


def test_a_rank_pulls_only_the_parts_it_holds(kvc: KVCloud) -> None:
    ns = make_ns()
    tokens, _ = stored_in_parts(kvc, ns, 2, chunks=1)
    part = kvc.lookup(ns, tokens).chunks[0].entry.size // 2
    res, _ = pull_heads(kvc, ns, tokens, (2, 4))
    assert res.bytes == part  # one of the two parts, not the chunk


def test_a_whole_chunk_serves_a_narrower_reader(kvc: KVCloud) -> None:
    """What a TP-1 engine stored, a TP-2 rank reads: its heads of the whole object."""
    ns = make_ns()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, 2 * ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(len(tokens))).astype(np.float16)
    kvc.push(ns, tokens, kv)
    res, got = pull_heads(kvc, ns, tokens, (2, 4))
    assert res.chunks == 2 and np.array_equal(got, kv[:, :, :, 2:4])


def encrypting(tmp_path: Path) -> KVCloud:
    """A client on the embedded backends that encrypts every tenant's objects."""
    return KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s",
        encrypt_tenants="*",
    )  # fmt: skip


def test_encrypted_parts_round_trip(tmp_path: Path) -> None:
    ns = make_ns()
    with encrypting(tmp_path) as kvc:
        tokens, kv = stored_in_parts(kvc, ns, 2)
        raw = (tmp_path / "o").rglob("*.b3")
        assert not any(kv[:, :, :16, :2].tobytes()[:64] in p.read_bytes() for p in raw)
        res, got = pull_heads(kvc, ns, tokens, (0, 2))
        assert res.chunks == 2 and np.array_equal(got, kv[:, :, :, :2])


def test_parts_in_the_wrong_order_are_a_miss_never_loaded(kvc: KVCloud) -> None:
    """An entry naming part 1 where part 0 belongs (a bug, or a forged entry): the header's
    head range is checked against the range asked for, the chunk is a miss, the entry
    dropped, and nothing of the wrong part lands in the destination."""
    ns = make_ns()
    tokens, _ = stored_in_parts(kvc, ns, 2, chunks=1)
    fp = kvc.fingerprints(ns, tokens)[0]
    e = kvc.lookup(ns, tokens).chunks[0].entry
    swapped = IndexEntry.of_parts(list(reversed(e.keys)), e.n_tokens, e.size, e.created)
    assert kvc.index.drop(ns.id, fp.hex(), e.object_key)
    kvc.index.register(ns.id, fp.hex(), swapped)
    res, _ = pull_heads(kvc, ns, tokens, (0, 4))
    assert res.chunks == 0 and res.failures[0][1].startswith("corrupt")
    assert kvc.index.lookup(ns.id, [fp.hex()]) == [None]


def test_a_corrupt_part_fails_its_chunk_and_the_ones_after(kvc: KVCloud, tmp_path: Path) -> None:
    ns = make_ns()
    tokens, _ = stored_in_parts(kvc, ns, 2)
    second = kvc.lookup(ns, tokens).chunks[0].entry.keys[1]
    path = next((tmp_path / "o").rglob(second.rsplit("/", 1)[-1]))
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    res = kvc.pull_detailed(kvc.lookup(ns, tokens))
    assert res.chunks == 0 and res.failures[0] == (0, "corrupt:DigestMismatchError")
    # the entry was dropped: the chunk is a miss for every rank, even one whose part is good
    res, _ = pull_heads(kvc, ns, tokens, (0, 2))
    assert res.chunks == 0


def test_part_headers_are_checked() -> None:
    ns = make_ns()
    kv = np.zeros((*ns.kv_shape(16)[:3], 2, 8), np.float16)
    fp, parent = b"\1" * 32, ns.digest
    seg = encode_segment(ns, fp, parent, kv, heads=(2, 4))
    assert seg.header.heads == (2, 4) and seg.header.layout == (3, 2, 8)
    decode_segment(seg.data, digest=seg.digest, ns=ns, heads=(2, 4))
    with pytest.raises(HeaderMismatchError, match="heads"):
        decode_segment(seg.data, digest=seg.digest, ns=ns)  # asked for a whole chunk
    with pytest.raises(HeaderMismatchError, match="heads"):
        decode_segment(seg.data, digest=seg.digest, ns=ns, heads=(0, 2))
    whole = encode_segment(ns, fp, parent, np.zeros(ns.kv_shape(16), np.float16))
    with pytest.raises(HeaderMismatchError, match="heads"):
        decode_segment(whole.data, digest=whole.digest, ns=ns, heads=(0, 2))
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, parent, kv, heads=(0, 3))  # 2 heads of KV for a range of 3
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, parent, kv, heads=(3, 5))  # past the namespace's heads
    # a header whose range disagrees with its layout is malformed
    import msgpack

    from kvcloud.segment import MAGIC, content_digest
    from kvcloud.segment.header import PREFIX as _PREFIX

    hlen = _PREFIX.unpack_from(seg.data)[1]
    h = msgpack.unpackb(bytes(seg.data[_PREFIX.size : _PREFIX.size + hlen]))
    h["heads"] = [1, 4]
    hb = msgpack.packb(h, use_bin_type=True)
    forged = _PREFIX.pack(MAGIC, len(hb)) + hb + bytes(seg.data[_PREFIX.size + hlen :])
    with pytest.raises(MalformedHeaderError):
        decode_segment(forged, digest=content_digest(forged), ns=ns, heads=(1, 4))


def test_verify_and_gc_keep_and_check_every_part(kvc: KVCloud, tmp_path: Path) -> None:
    ns = make_ns()
    tokens, _ = stored_in_parts(kvc, ns, 2)
    rep = verify(kvc.store, kvc.index, deep=True)
    assert rep.clean and rep.entries_ok == 2 and rep.referenced_objects == 4 and rep.orphans == 0
    # gc keeps every part an entry names, however old
    rep = gc(kvc.store, kvc.index, grace_seconds=0, settle_seconds=0)
    assert rep.objects_deleted == 0
    assert kvc.pull_detailed(kvc.lookup(ns, tokens)).chunks == 2
    # a missing part is a missing entry, and repair drops it
    second = kvc.lookup(ns, tokens).chunks[1].entry.keys[1]
    kvc.store.delete(second)
    rep = verify(kvc.store, kvc.index, repair=True)
    assert rep.missing == 1 and rep.entries_dropped == 1
    assert [p.object_key for p in rep.problems] == [second]
    # gc over budget frees the parts of the entries it drops
    rep = gc(kvc.store, kvc.index, grace_seconds=0, max_bytes=0, settle_seconds=0)
    assert rep.entries_dropped == 1 and rep.objects_deleted == 3  # 2 parts + the orphan left
    assert kvc.lookup(ns, tokens).chunks == ()


def test_register_parts_refuses_an_uneven_split(kvc: KVCloud) -> None:
    with pytest.raises(LayoutError):
        kvc.register_parts(make_ns(), b"\1" * 32, ["a", "b", "c"], 16, 3)
    with pytest.raises(ValueError):
        IndexEntry.of_parts(["a,b"], 16, 1, 0.0)


def test_offered_parts_register_the_chunk_once_the_last_is_in(kvc: KVCloud) -> None:
    """No coordinator: each writer records its part, the one that finds every part recorded
    registers the chunk; before that the chunk is a miss. Part records are entries deep
    verify accepts (they name real parts) and no prompt's chain reaches."""
    ns = make_ns()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 50_000, ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(ns.chunk_tokens)).astype(np.float16)
    fp = kvc.fingerprints(ns, tokens)[0]
    offered = []
    for lo, hi in [(2, 4), (0, 2)]:  # in any order
        key, size = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, lo:hi], (lo, hi))
        assert kvc.lookup(ns, tokens).tokens == 0
        offered.append(kvc.offer_part(ns, fp, (lo, hi), key, size, ns.chunk_tokens, 2))
    assert offered == [False, True]
    assert np.array_equal(kvc.pull(kvc.lookup(ns, tokens)), kv)
    # offered again (a retry): the entry stands, nothing registered twice
    key, size = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, :2], (0, 2))
    assert kvc.offer_part(ns, fp, (0, 2), key, size, ns.chunk_tokens, 2) is False
    rep = verify(kvc.store, kvc.index, deep=True)
    assert rep.clean and rep.entries_checked == 3 and rep.orphans == 0


def test_a_broken_part_is_not_registered_again_by_the_next_offer(
    kvc: KVCloud, tmp_path: Path
) -> None:
    """A part found corrupt drops the chunk's entry and that part's record, so the next
    writer to offer its own (good) part of the chunk cannot find every record and register
    the broken grid again; once the bad part is stored again, the chunk registers."""
    ns = make_ns()
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 50_000, ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(ns.chunk_tokens)).astype(np.float16)
    fp = kvc.fingerprints(ns, tokens)[0]
    parts = {}
    for lo, hi in [(0, 2), (2, 4)]:
        parts[lo] = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, lo:hi], (lo, hi))
        kvc.offer_part(ns, fp, (lo, hi), *parts[lo], ns.chunk_tokens, 2)
    bad_key = parts[2][0]
    path = next((tmp_path / "o").rglob(bad_key.rsplit("/", 1)[-1]))
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    assert kvc.pull_detailed(kvc.lookup(ns, tokens)).chunks == 0
    assert not path.exists()  # bytes that do not hash to their key: deleted after the entry
    # rank 0 offers its part again (the prefix came back): the broken grid stays a miss
    key, size = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, 0:2], (0, 2))
    assert kvc.offer_part(ns, fp, (0, 2), key, size, ns.chunk_tokens, 2) is False
    assert kvc.lookup(ns, tokens).tokens == 0
    # rank 1 stores its part again (the same bytes: the same key, written again whole)
    key, size = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, 2:4], (2, 4))
    assert kvc.offer_part(ns, fp, (2, 4), key, size, ns.chunk_tokens, 2) is True
    assert np.array_equal(kvc.pull(kvc.lookup(ns, tokens)), kv)


def test_a_partial_grid_ages_out_however_often_it_is_offered(tmp_path: Path) -> None:
    """A rank whose part never comes (dropped on a full queue) leaves its siblings' records
    alone in the index. Offering them again (the prefix is computed again and again) must not
    renew the records the offer reads: one TTL after its write each record is gone, and
    with it what keeps its part from gc."""
    kvc = KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s",
        ttl_seconds=100,
    )  # fmt: skip
    ns = make_ns()
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 50_000, ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(ns.chunk_tokens)).astype(np.float16)
    fp = kvc.fingerprints(ns, tokens)[0]
    key, size = kvc.store_part(ns, fp, ns.digest, kv[:, :, :, 0:2], (0, 2))
    assert kvc.offer_part(ns, fp, (0, 2), key, size, ns.chunk_tokens, 2) is False
    record = part_record_fp(fp, (0, 2), None).hex()
    (written,) = [r.expires_at for r in kvc.index.iter_entries(ns.id) if r.fp == record]
    time.sleep(1.2)  # with a 100 s TTL, a hit older than 1 s is due for renewal
    for _ in range(3):  # rank 0 offers again; rank 1's part never comes
        assert kvc.offer_part(ns, fp, (0, 2), key, size, ns.chunk_tokens, 2) is False
    time.sleep(0.5)  # past any background renewal's batching
    (now,) = [r.expires_at for r in kvc.index.iter_entries(ns.id) if r.fp == record]
    assert now == pytest.approx(written, abs=0.05)
    kvc.close()


# -- pipeline stages: parts by layer range ------------------------------------------------------

STAGES = [0, 1, 3]  # uneven, as vLLM splits layers that do not divide evenly


def stored_in_stages(kvc: KVCloud, ns: Namespace, n_parts: int, seed: int = 11):  # type: ignore[no-untyped-def]
    """One chunk stored as a grid of pipeline stages × head parts, each part offered by its
    own writer in a shuffled order; returns the tokens, the KV and the offers' answers."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(ns.chunk_tokens)).astype(np.float16)
    fp = kvc.fingerprints(ns, tokens)[0]
    w = H // n_parts
    cells = [
        ((a, b), None if n_parts == 1 else (j * w, (j + 1) * w))
        for a, b in itertools.pairwise(STAGES)
        for j in range(n_parts)
    ]
    rng.shuffle(cells)  # type: ignore[arg-type]
    offered = []
    for (a, b), heads in cells:
        lo, hi = heads or (0, H)
        key, size = kvc.store_part(ns, fp, ns.digest, kv[a:b, :, :, lo:hi], heads, layers=(a, b))
        offered.append(
            kvc.offer_part(
                ns, fp, heads, key, size, ns.chunk_tokens, n_parts, layers=(a, b), stages=STAGES
            )
        )
    return tokens, kv, offered


@pytest.mark.parametrize("n_parts", [1, 2])
def test_stage_parts_register_once_all_are_in_and_read_back_by_any_range(
    kvc: KVCloud, n_parts: int
) -> None:
    ns = make_ns()
    tokens, kv, offered = stored_in_stages(kvc, ns, n_parts)
    assert offered == [False] * (len(offered) - 1) + [True]
    entry = kvc.lookup(ns, tokens).chunks[0].entry
    assert [s[0] for s in entry.stages] == [(0, 1), (1, 3)]
    assert np.array_equal(kvc.pull(kvc.lookup(ns, tokens)), kv)  # a PP-1, TP-1 reader
    for layers, heads in [((1, 3), None), ((0, 1), (2, 4)), ((0, 2), (1, 3)), ((2, 3), (0, 4))]:
        m = kvc.lookup(ns, tokens)
        n_l, n_h, d = part_layout(ns, heads, layers)
        dest = np.zeros((n_l, 2, ns.chunk_tokens, n_h, d), np.float16)
        res = kvc.pull_into(m, [dest], heads=heads, layers=layers)
        lo, hi = heads or (0, H)
        assert res.chunks == 1 and not res.failures, (layers, heads)
        assert np.array_equal(dest, kv[layers[0] : layers[1], :, :, lo:hi]), (layers, heads)
    rep = verify(kvc.store, kvc.index, deep=True)
    assert rep.clean and rep.orphans == 0, rep.problems
    assert gc(kvc.store, kvc.index, grace_seconds=0, settle_seconds=0).objects_deleted == 0


def test_a_stage_pulls_only_its_layers(kvc: KVCloud) -> None:
    ns = make_ns()
    tokens, _, _ = stored_in_stages(kvc, ns, 1)
    m = kvc.lookup(ns, tokens)
    dest = np.zeros((2, 2, ns.chunk_tokens, H, 8), np.float16)
    res = kvc.pull_into(m, [dest], layers=(1, 3))
    assert res.bytes == kvc.store.head(m.chunks[0].entry.keys[1]).size  # the second stage's


def test_a_whole_chunk_serves_a_stage(kvc: KVCloud) -> None:
    """What a PP-1 engine stored, a pipeline stage reads: its layers of the whole object."""
    ns = make_ns()
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50_000, ns.chunk_tokens)
    kv = rng.standard_normal(ns.kv_shape(ns.chunk_tokens)).astype(np.float16)
    kvc.push(ns, tokens, kv)
    dest = np.zeros((2, 2, ns.chunk_tokens, 2, 8), np.float16)
    res = kvc.pull_into(kvc.lookup(ns, tokens), [dest], heads=(2, 4), layers=(1, 3))
    assert res.chunks == 1 and np.array_equal(dest, kv[1:3, :, :, 2:4])


def test_stages_in_the_wrong_order_are_a_miss_never_loaded(kvc: KVCloud) -> None:
    """An entry whose stages name each other's parts: each header's layer range is checked
    against the stage asked for; a miss, the entry dropped, verify names it."""
    ns = make_ns()
    tokens, _, _ = stored_in_stages(kvc, ns, 1)
    fp = kvc.fingerprints(ns, tokens)[0]
    e = kvc.lookup(ns, tokens).chunks[0].entry
    (_, k0), (_, k1) = e.stages
    forged = IndexEntry.of_grid([((0, 2), k1), ((2, 3), k0)], e.n_tokens, e.size, e.created)
    assert kvc.index.drop(ns.id, fp.hex(), e.object_key)
    kvc.index.register(ns.id, fp.hex(), forged)
    assert any(p.kind == "corrupt" for p in verify(kvc.store, kvc.index, deep=True).problems)
    res = kvc.pull_detailed(kvc.lookup(ns, tokens))
    assert res.chunks == 0 and res.failures[0][1].startswith("corrupt")
    assert kvc.index.lookup(ns.id, [fp.hex()]) == [None]


def test_stage_headers_and_grids_are_checked(kvc: KVCloud) -> None:
    ns = make_ns()
    kv = np.zeros((2, 2, 16, H, 8), np.float16)
    fp = b"\1" * 32
    seg = encode_segment(ns, fp, ns.digest, kv, layers=(1, 3))
    assert seg.header.layers == (1, 3) and seg.header.layout == (2, H, 8)
    decode_segment(seg.data, digest=seg.digest, ns=ns, layers=(1, 3))
    with pytest.raises(HeaderMismatchError, match="layers"):
        decode_segment(seg.data, digest=seg.digest, ns=ns)  # asked for every layer
    with pytest.raises(LayoutError):
        encode_segment(ns, fp, ns.digest, kv, layers=(2, 4))  # past the namespace's layers
    with pytest.raises(LayoutError):
        kvc.offer_part(ns, fp, None, "k", 1, 16, 1, layers=(1, 2), stages=STAGES)
    with pytest.raises(LayoutError):
        kvc.offer_part(ns, fp, None, "k", 1, 16, 1, layers=(0, 1), stages=[0, 1, 4])
    # an entry whose stages do not tile the layers is a miss, never loaded
    tokens = np.arange(16)
    fp = kvc.fingerprints(ns, tokens)[0]
    key, size = kvc.store_part(ns, fp, ns.digest, kv, None, layers=(1, 3))
    kvc.index.register(ns.id, fp.hex(), IndexEntry(f"{key},{key},@stages=1-3-5", 16, size, 0.0))
    res = kvc.pull_detailed(kvc.lookup(ns, tokens))
    assert res.chunks == 0 and res.failures == [(0, "corrupt:parts")]
    with pytest.raises(ValueError):  # stages not adjacent
        IndexEntry.of_grid([((0, 1), ["a"]), ((2, 3), ["c"])], 16, 1, 0.0)
    with pytest.raises(ValueError):  # stages of unequal parts
        IndexEntry.of_grid([((0, 1), ["a"]), ((1, 3), ["b", "c"])], 16, 1, 0.0)


def test_grid_keys_parse_and_plain_keys_stay_plain() -> None:
    from kvcloud.indexes.base import object_keys_of, parse_stages

    e = IndexEntry.of_grid([((0, 2), ["a", "b"]), ((2, 4), ["c", "d"])], 16, 1, 0.0)
    # the stages' boundaries ride last, so a release that does not know grids still sees
    # every part's key where it always did (its gc keeps them all)
    assert e.object_key == "a,b,c,d,@stages=0-2-4"
    assert e.object_key.split(",")[:4] == ["a", "b", "c", "d"]
    assert parse_stages(e.object_key) == (((0, 2), ("a", "b")), ((2, 4), ("c", "d")))
    assert object_keys_of(e.object_key) == ("a", "b", "c", "d")
    assert parse_stages("ns/ab/abc.b3l") == ((None, ("ns/ab/abc.b3l",)),)
    # a marker that does not parse, or parts that do not split over it: a plain key list
    assert parse_stages("a,@stages=0") == ((None, ("a", "@stages=0")),)
    assert parse_stages("a,b,c,@stages=0-1-2") == ((None, ("a", "b", "c", "@stages=0-1-2")),)


def test_encrypted_stage_parts_round_trip(tmp_path: Path) -> None:
    """A stage's layer range is bound into an encrypted part's AAD as its head range is."""
    ns = make_ns()
    with encrypting(tmp_path) as kvc:
        tokens, kv, offered = stored_in_stages(kvc, ns, 2)
        assert offered[-1] is True
        assert np.array_equal(kvc.pull(kvc.lookup(ns, tokens)), kv)
        dest = np.zeros((2, 2, ns.chunk_tokens, 2, 8), np.float16)
        res = kvc.pull_into(kvc.lookup(ns, tokens), [dest], heads=(0, 2), layers=(1, 3))
        assert res.chunks == 1 and np.array_equal(dest, kv[1:3, :, :, 0:2])
    seg = encode_segment(
        ns, b"\1" * 32, ns.digest, kv[1:3, :, :, 0:2], heads=(0, 2), layers=(1, 3),
        key=kvc.data_key("default"),
    )  # fmt: skip
    assert seg.header.aad() != replace(seg.header, layers=None).aad()
