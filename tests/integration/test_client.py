"""The client API end to end against the embedded default and real server processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from kvcloud import KVCloud, LayoutError, SessionNotFoundError
from kvcloud.segment import encode_segment
from tests.helpers import DTYPE_CASES, make_kv, make_ns, make_tokens, same_bits
from tests.integration.conftest import Backends


def _objects(kv: KVCloud) -> list[str]:
    return sorted(i.key for i in kv.store.list())


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("n_chunks", [1, 2, 40])
def test_round_trip_bit_exact(backends: Backends, dtype: str, n_chunks: int) -> None:
    ns = make_ns(dtype)
    c = ns.chunk_tokens
    n = n_chunks * c + 5  # a partial tail that must not be pushed
    toks, kv_arr = make_tokens(n, seed=n_chunks), make_kv(ns, n, seed=n_chunks)
    with backends.open() as kv:
        res = kv.push(ns, toks, kv_arr, tenant="acme")
        assert (res.chunks, res.pushed, res.failed) == (n_chunks, n_chunks, 0)
        assert res.objects_written == n_chunks and len(set(res.keys)) == n_chunks
        assert len(_objects(kv)) == n_chunks  # the tail is not there
        again = kv.push(ns, toks, kv_arr, tenant="acme")
        assert (again.already_indexed, again.pushed, again.objects_written) == (n_chunks, 0, 0)
    # a different process-level client sees it
    with backends.open() as kv:
        m = kv.lookup(ns, toks, tenant="acme")
        assert m.tokens == n_chunks * c and len(m.chunks) == n_chunks
        arr = kv.pull(m)
        assert same_bits(arr, np.ascontiguousarray(kv_arr[:, :, : n_chunks * c]))
        out = np.zeros(ns.kv_shape(n), dtype=ns.dtype_info.storage)
        view = kv.pull(m, out=out)
        assert view.base is out or np.shares_memory(view, out)
        assert same_bits(out[:, :, : n_chunks * c], kv_arr[:, :, : n_chunks * c])
        # a prompt that extends the prefix matches it; one that diverges in chunk 1 does not
        longer = np.concatenate([toks, make_tokens(3 * c, seed=99)])
        assert kv.lookup(ns, longer, tenant="acme").tokens == n_chunks * c
        if n_chunks > 1:
            diverged = toks.copy()
            diverged[c + 1] = (diverged[c + 1] + 1) % 50_000
            assert kv.lookup(ns, diverged, tenant="acme").tokens == c


def test_default_chunk_size_and_pages(backends: Backends) -> None:
    ns = make_ns(chunk_tokens=256)
    toks, arr = make_tokens(3 * 256 + 17), make_kv(ns, 3 * 256 + 17)
    with backends.open() as kv:
        kv.push(ns, toks, arr)
        m = kv.lookup(ns, toks)
        assert m.tokens == 768
        pages = [np.zeros(ns.kv_shape(256), np.float16) for _ in range(3)]
        res = kv.pull_into(m, pages)
        assert res.tokens == 768 and not res.failures
        for i, page in enumerate(pages):
            assert same_bits(page, arr[:, :, i * 256 : (i + 1) * 256])


def test_tenants_and_namespaces_are_isolated(backends: Backends) -> None:
    ns = make_ns()
    toks, arr = make_tokens(64), make_kv(ns, 64)
    with backends.open() as kv:
        kv.push(ns, toks, arr, tenant="a")
        assert kv.lookup(ns, toks, tenant="a").tokens == 64
        assert kv.lookup(ns, toks, tenant="b").tokens == 0
        assert kv.lookup(make_ns(revision="r2"), toks, tenant="a").tokens == 0
    with backends.open(secret="another-secret") as kv:
        assert kv.lookup(ns, toks, tenant="a").tokens == 0


def _corrupt(kv: KVCloud, key: str, how: str, other_key: str) -> None:
    data = kv.store.get(key)
    kv.store.delete(key)
    if how == "deleted":
        return
    if how == "truncated":
        kv.store.put(key, data[: len(data) // 2])
    elif how == "bitflip":
        bad = bytearray(data)
        bad[len(bad) // 3] ^= 0x10
        kv.store.put(key, bytes(bad))
    elif how == "swapped":  # another chunk's valid object under this key
        kv.store.put(key, kv.store.get(other_key))


@pytest.mark.parametrize("how", ["deleted", "truncated", "bitflip", "swapped"])
def test_bad_object_truncates_match_and_drops_entry(backends: Backends, how: str) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(5 * c), make_kv(ns, 5 * c)
    with backends.open() as kv:
        res = kv.push(ns, toks, arr)
        _corrupt(kv, res.keys[2], how, res.keys[3])
        m = kv.lookup(ns, toks)
        assert m.tokens == 5 * c  # the index is only a hint: it still claims all of it
        pulled = kv.pull_detailed(m)
        assert pulled.tokens == 2 * c
        assert same_bits(pulled.array, arr[:, :, : 2 * c])
        assert [p for p, _ in pulled.failures] == [2]
        stats = kv.stats()
        reason = "missing_objects" if how == "deleted" else "verify_failures"
        assert stats[reason] == 1 and stats["entries_dropped"] == 1
        # the bad entry is gone; the good ones stay
        fps = kv.fingerprints(ns, toks)
        entries = kv.index.lookup(ns.id, [f.hex() for f in fps])
        assert [e is not None for e in entries] == [True, True, False, True, True]
        assert kv.lookup(ns, toks).tokens == 2 * c
        # bytes that do not hash to their key are deleted after their entry: else the next
        # push of the same chunk (the same key) finds them "already there" and names them
        assert stats.get("damaged_deleted", 0) == (0 if how == "deleted" else 1)
        assert kv.store.head(res.keys[2]) is None
        assert kv.store.head(res.keys[3]) is not None
        # pushing again repairs it: the object is rewritten and the entry comes back
        kv.push(ns, toks, arr)
        assert same_bits(kv.pull(kv.lookup(ns, toks)), arr)


def test_entry_pointing_at_another_valid_object_is_rejected(backends: Backends) -> None:
    """An index entry rewritten to name a different (valid, correctly addressed) object:
    the digest checks out but the header names another fingerprint."""
    ns = make_ns()
    c = ns.chunk_tokens
    toks, arr = make_tokens(3 * c), make_kv(ns, 3 * c)
    with backends.open() as kv:
        res = kv.push(ns, toks, arr)
        fps = kv.fingerprints(ns, toks)
        entry = kv.index.lookup(ns.id, [fps[1].hex()])[0]
        assert entry is not None
        kv.index.drop(ns.id, fps[1].hex())
        forged = type(entry)(res.keys[2], entry.n_tokens, entry.size, entry.created)
        assert kv.index.register(ns.id, fps[1].hex(), forged)
        pulled = kv.pull_detailed(kv.lookup(ns, toks))
        assert pulled.tokens == c
        assert kv.stats()["verify_failures"] == 1
        # a good object under a wrong entry is not deleted: chunk 2 still restores
        assert "damaged_deleted" not in kv.stats()
        kv.push(ns, toks[: 2 * c], arr[:, :, : 2 * c])
        assert same_bits(kv.pull(kv.lookup(ns, toks)), arr)


def test_sessions_round_trip_with_tail_and_tenant_scope(backends: Backends) -> None:
    ns = make_ns()
    toks, arr = make_tokens(3 * ns.chunk_tokens + 7), make_kv(ns, 3 * ns.chunk_tokens + 7)
    with backends.open() as kv:
        rec = kv.save_session(ns, "sess-1", toks, arr, tenant="acme", meta={"turns": 2})
        assert rec.tail_key is not None and len(rec.chunk_keys) == 3
    with backends.open() as kv:
        loaded = kv.load_session(ns, "sess-1", tenant="acme")
        assert np.array_equal(loaded.tokens, toks) and loaded.meta == {"turns": 2}
        pulled = kv.pull_session(ns, loaded, tenant="acme")
        assert pulled.tokens == len(toks) and same_bits(pulled.array, arr)
        with pytest.raises(SessionNotFoundError):
            kv.load_session(ns, "sess-1", tenant="other")
        with pytest.raises(SessionNotFoundError):
            kv.load_session(ns, "nope", tenant="acme")
        assert kv.delete_session("sess-1", tenant="acme")
        with pytest.raises(SessionNotFoundError):
            kv.load_session(ns, "sess-1", tenant="acme")


def test_push_rejects_mismatched_array(backends: Backends) -> None:
    ns = make_ns()
    with backends.open() as kv, pytest.raises(LayoutError):
        kv.push(ns, make_tokens(32), make_kv(ns, 10))


def test_counters_reach_the_index(backends: Backends) -> None:
    ns = make_ns()
    toks, arr = make_tokens(48), make_kv(ns, 48)
    with backends.open() as kv:
        kv.push(ns, toks, arr)
        for _ in range(3):
            kv.pull(kv.lookup(ns, toks))
        kv.lookup(ns, make_tokens(48, seed=5))
    with backends.open() as kv:
        counters = kv.index.counters()
    assert counters["lookups"] == 4
    assert counters["chunks_hit"] == 9 and counters["chunks_missed"] == 3
    assert counters["bytes_pulled"] > 0 and counters["chunks_pushed"] == 3


def _push_worker(args: tuple[str, str, int]) -> tuple[int, int, bool]:
    store, index, seed = args
    ns = make_ns()
    toks, arr = make_tokens(8 * ns.chunk_tokens), make_kv(ns, 8 * ns.chunk_tokens)
    # overlapping prefixes: half the workers push a longer prompt sharing the first chunks
    if seed % 2:
        toks = np.concatenate([toks, make_tokens(2 * ns.chunk_tokens, seed=77)])
        arr = np.concatenate([arr, make_kv(ns, 2 * ns.chunk_tokens, seed=77)], axis=2)
    with KVCloud.open(store=store, index=index) as kv:
        res = kv.push(ns, toks, arr)
        pulled = kv.pull(kv.lookup(ns, toks))
        return res.pushed, res.objects_written, same_bits(pulled, arr)


def test_eight_processes_push_the_same_prefix(backends: Backends) -> None:
    ctx = mp.get_context("spawn")
    with ctx.Pool(8) as pool:
        results = pool.map(_push_worker, [(backends.store, backends.index, i) for i in range(8)])
    assert all(ok for _, _, ok in results)
    ns = make_ns()
    with backends.open() as kv:
        # 8 shared chunks + 2 chunks only the odd workers pushed
        assert len(_objects(kv)) == 10
        assert kv.index.count_entries(ns.id) == 10
        toks = np.concatenate(
            [make_tokens(8 * ns.chunk_tokens), make_tokens(2 * ns.chunk_tokens, seed=77)]
        )
        assert kv.lookup(ns, toks).tokens == 10 * ns.chunk_tokens
    assert sum(p for p, _, _ in results) >= 10  # every chunk registered by someone
    assert sum(w for _, w, _ in results) >= 10


def test_dead_backends_are_a_miss_not_an_error(tmp_path) -> None:
    from tests.servers import free_port

    ns = make_ns()
    toks = make_tokens(64)
    port = free_port()  # nothing listens here
    t0 = time.monotonic()
    with KVCloud.open(
        store=f"file://{tmp_path / 'o'}",
        index=f"redis://127.0.0.1:{port}/0",
        connect_timeout=0.5,
        read_timeout=0.5,
    ) as kv:
        m = kv.lookup(ns, toks)
        assert m.tokens == 0 and kv.stats()["index_errors"] == 1
    assert time.monotonic() - t0 < 10


def test_unreachable_store_on_pull_is_counted(backends: Backends, tmp_path) -> None:
    ns = make_ns()
    toks, arr = make_tokens(64), make_kv(ns, 64)
    with backends.open() as kv:
        kv.push(ns, toks, arr)
        m = kv.lookup(ns, toks)
    # same index, a store that answers nothing: every chunk is a miss, no exception
    from tests.servers import free_port

    dead = (
        f"s3://kvcloud/x?endpoint_url=http://127.0.0.1:{free_port()}&region=us-east-1"
        "&max_attempts=1"
    )
    with KVCloud.open(
        store=dead, index=backends.index, connect_timeout=0.5, read_timeout=0.5
    ) as kv2:
        res = kv2.pull_detailed(m)
        assert res.tokens == 0 and kv2.stats()["store_errors"] == 4
        # a transient outage must not drop the entries
        assert kv2.lookup(ns, toks).tokens == 64


def test_encoded_segment_matches_what_push_stored(backends: Backends) -> None:
    ns = make_ns()
    toks, arr = make_tokens(16), make_kv(ns, 16)
    with backends.open() as kv:
        res = kv.push(ns, toks, arr)
        fp = kv.fingerprints(ns, toks)[0]
        seg = encode_segment(ns, fp, ns.digest, arr)
        assert res.keys == [seg.key()]
        assert kv.store.get(seg.key()) == bytes(seg.data)


def test_session_with_unstored_last_token_and_bad_tail(backends: Backends) -> None:
    ns = make_ns()
    c = ns.chunk_tokens
    toks = make_tokens(2 * c + 6)
    arr = make_kv(ns, 2 * c + 5)  # the last sampled token has no KV yet
    with backends.open() as kv:
        rec = kv.save_session(ns, "s2", toks, arr)
        assert rec.kv_tokens == 2 * c + 5 and rec.n_tokens == 2 * c + 6
        loaded = kv.load_session(ns, "s2")
        assert loaded.kv_tokens == rec.kv_tokens and loaded.tail_key == rec.tail_key
        pulled = kv.pull_session(ns, loaded)
        assert pulled.tokens == 2 * c + 5 and same_bits(pulled.array, arr)
        # a damaged tail costs only the tail: the full chunks still restore
        assert loaded.tail_key is not None
        data = bytearray(kv.store.get(loaded.tail_key))
        data[-1] ^= 0xFF
        kv.store.delete(loaded.tail_key)
        kv.store.put(loaded.tail_key, bytes(data))
        pulled = kv.pull_session(ns, loaded)
        assert pulled.tokens == 2 * c and same_bits(pulled.array, arr[:, :, : 2 * c])
        assert kv.stats()["verify_failures"] == 1
