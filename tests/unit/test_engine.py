"""The engine with the tiny preset: a real forward pass, real pages, a real file store."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcloud import KVCloud
from workers.config import WorkerOptions
from workers.engine import CompletionRequest, Engine
from workers.engine.model import Decoder, ModelConfig, preset
from workers.engine.pages import SeqPages
from workers.errors import BadRequestError, CacheFullError, ContextLengthError, SessionUnknownError

C = 16


def opts(tmp: Path | None, **kw: object) -> WorkerOptions:
    base: dict[str, object] = dict(model="tiny", cache_pages=32, chunk_tokens=C)
    if tmp is not None:
        base.update(store=f"file://{tmp / 'objects'}", index=f"sqlite://{tmp / 'index.db'}")
    base.update(kw)
    return WorkerOptions(**base)  # type: ignore[arg-type]


def req(tokens: list[int], n: int = 8, **kw: object) -> CompletionRequest:
    return CompletionRequest(prompt_tokens=tokens, max_tokens=n, stop_at_eos=False, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, n)]


def test_presets_are_identical_across_instances_and_depend_on_seed() -> None:
    a, b = Decoder(preset("tiny", 0)), Decoder(preset("tiny", 0))
    c = Decoder(preset("tiny", 1))
    for (na, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), na
        assert not torch.equal(pa, pc) or na.endswith("norm.weight"), na


def test_small_preset_shape() -> None:
    cfg = preset("small")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        12,
        768,
        12,
        4,
        64,
    )
    assert cfg.ffn_dim == 2048 and cfg.max_context >= 8192
    assert preset("tiny").max_context >= 2048


@pytest.mark.parametrize("tied", [True, False])
def test_paged_prefill_equals_one_shot_logits(tied: bool) -> None:
    """Prefill in two steps over pages == one pass (the cache path is the same maths)."""
    cfg = ModelConfig("t", 258, 32, 2, 4, 2, 8, 64, 512, tie_embeddings=tied)
    model = Decoder(cfg)
    pool = torch.zeros(8, 2, 2, C, 2, 8, dtype=torch.float32)

    class Pool:
        data = pool
        chunk_tokens = C
        device = torch.device("cpu")

    toks = torch.tensor(prompt(40))
    full = model(toks, 0, SeqPages(Pool, [0, 1, 2]), last_only=False)  # type: ignore[arg-type]
    pool2 = Pool()
    pool2.data = torch.zeros_like(pool)
    seq = SeqPages(pool2, [3, 4, 5])  # type: ignore[arg-type]
    first = model(toks[:25], 0, seq, last_only=False)
    rest = model(toks[25:], 25, seq, last_only=False)
    both = torch.cat([first, rest])
    assert torch.allclose(full, both, atol=1e-4)
    assert full.argmax(-1).tolist() == both.argmax(-1).tolist()


def test_greedy_is_deterministic_and_prefix_is_reused() -> None:
    e = Engine(opts(None))
    p = prompt(50)
    r1 = e.complete(req(p))
    r2 = e.complete(req(p))
    assert r1.tokens == r2.tokens
    assert (r1.tokens_local, r1.tokens_computed) == (0, 50)
    assert r2.tokens_local == 48 and r2.tokens_computed == 2
    # a different early token changes the output: the model really reads its context
    q = list(p)
    q[1] ^= 1
    assert e.complete(req(q, 16)).tokens != e.complete(req(p, 16)).tokens


def test_seeded_sampling_is_reproducible() -> None:
    e = Engine(opts(None))
    p = prompt(20)
    a = e.complete(req(p, 12, temperature=1.0, seed=7)).tokens
    b = e.complete(req(p, 12, temperature=1.0, seed=7)).tokens
    c = e.complete(req(p, 12, temperature=1.0, seed=8)).tokens
    assert a == b and a != c


def test_fully_cached_prompt_does_not_modify_shared_pages() -> None:
    e = Engine(opts(None))
    p = prompt(2 * C)
    e.complete(req(p))
    before = e.pool.data.clone()
    pages = [cp.page for cp in e.prefix.pages()]
    r = e.complete(req(p))
    assert r.tokens_local == 2 * C - 1 and r.tokens_computed == 1
    for page in pages:
        assert torch.equal(before[page], e.pool.data[page])


def test_session_continues_with_history() -> None:
    e = Engine(opts(None))
    sid = e.create_session("t")
    r1 = e.complete(req(prompt(20, 1), 5, session_id=sid, tenant="t"))
    r2 = e.complete(req(prompt(30, 2), 5, session_id=sid, tenant="t"))
    assert r1.session_tokens == 25 and r2.session_tokens == 60
    assert r2.prompt_tokens == 55 and r2.tokens_local == 24 and r2.tokens_computed == 31
    info = e.session_info(sid, "t")
    assert info.tokens == 60 and info.kv_tokens == 59 and info.resident
    with pytest.raises(SessionUnknownError):
        e.complete(req(prompt(3), session_id=sid, tenant="other"))
    with pytest.raises(SessionUnknownError):
        e.complete(req(prompt(3), session_id="sess_nope", tenant="t"))


def _conversation(e: Engine, sid: str, turns: list[list[int]]) -> list[list[int]]:
    return [e.complete(req(t, 9, session_id=sid)).tokens for t in turns]


def test_session_moves_between_engines_bit_identical(tmp_path: Path) -> None:
    turns = [prompt(41, 1), prompt(23, 2), prompt(37, 3)]
    ref_engine = Engine(opts(None))
    ref = _conversation(ref_engine, ref_engine.create_session("default"), turns)
    a = Engine(opts(tmp_path))
    sid = a.create_session("default")
    got = _conversation(a, sid, turns[:2])
    fr = a.flush_session(sid, "default")
    # the session's full pages went to the uploader at the end of each turn (write-through):
    # the flush pushes whichever of them it has not stored yet
    assert fr.stored and fr.kv_tokens == fr.tokens - 1 and fr.chunks_pushed <= fr.kv_tokens // C
    a.close()
    b = Engine(opts(tmp_path))
    r = b.complete(req(turns[2], 9, session_id=sid))
    assert [*got, r.tokens] == ref
    assert r.tokens_remote == fr.kv_tokens and r.tokens_local == 0
    assert r.tokens_computed == r.prompt_tokens - fr.kv_tokens


def test_eviction_writes_back_and_another_engine_restores(tmp_path: Path) -> None:
    a = Engine(opts(tmp_path, cache_pages=4))
    long = prompt(3 * C + 5, 5)
    a.complete(req(long, 2))
    a.complete(req(prompt(3 * C, 6), 2))  # 4 pages in the pool: the first prompt's go
    assert a.uploader is not None and a.uploader.drain(10)
    assert a.metrics.evictions._value.get() > 0
    with KVCloud.open(store=a.options.store, index=a.options.index) as kv:
        assert sum(1 for _ in kv.store.list()) > 0
    b = Engine(opts(tmp_path))
    r = b.complete(req(long, 2))
    assert r.tokens_remote > 0


def test_write_through_uploads_pages_as_they_fill(tmp_path: Path) -> None:
    a = Engine(opts(tmp_path, write_policy="write-through"))
    a.complete(req(prompt(3 * C + 3, 9), 2))
    assert a.uploader is not None and a.uploader.drain(10)
    with KVCloud.open(store=a.options.store, index=a.options.index) as kv:
        assert sum(1 for _ in kv.store.list()) == 3
    assert all(cp.stored for cp in a.prefix.pages())


def test_write_policy_off_never_uploads(tmp_path: Path) -> None:
    a = Engine(opts(tmp_path, write_policy="off", cache_pages=4))
    a.complete(req(prompt(3 * C, 5), 2))
    a.complete(req(prompt(3 * C, 6), 2))
    assert a.uploader is None
    with KVCloud.open(store=a.options.store, index=a.options.index) as kv:
        assert sum(1 for _ in kv.store.list()) == 0


def test_full_upload_queue_drops_and_never_blocks(tmp_path: Path) -> None:
    a = Engine(opts(tmp_path, cache_pages=4, upload_queue=1))
    assert a.uploader is not None and a.kv is not None
    gate = threading.Event()
    real_push = a.kv.push_chunks

    def slow_push(*args: object, **kw: object):  # the store is stuck until the gate opens
        gate.wait(20)
        return real_push(*args, **kw)

    a.kv.push_chunks = slow_push  # type: ignore[method-assign]
    t0 = time.monotonic()
    for s in range(6):
        a.complete(req(prompt(3 * C, 10 + s), 1))
    assert time.monotonic() - t0 < 15  # decoding did not wait for the stuck uploads
    assert a.metrics.uploads.labels("dropped")._value.get() > 0
    gate.set()
    assert a.uploader.drain(10)


def test_unreachable_store_still_answers(tmp_path: Path) -> None:
    from tests.servers import free_port

    dead = f"s3://b/p?endpoint_url=http://127.0.0.1:{free_port()}&max_attempts=1"
    e = Engine(opts(None, store=dead, index=f"sqlite://{tmp_path / 'i.db'}", remote_timeout=0.5))
    ref = Engine(opts(None))
    p = prompt(3 * C)
    t0 = time.monotonic()
    assert e.complete(req(p)).tokens == ref.complete(req(p)).tokens
    assert time.monotonic() - t0 < 15


def test_bad_requests() -> None:
    e = Engine(opts(None))
    with pytest.raises(BadRequestError):
        e.complete(req([]))
    with pytest.raises(BadRequestError):
        e.complete(req([300]))
    with pytest.raises(BadRequestError):
        e.complete(req([1], 0))
    with pytest.raises(ContextLengthError):
        e.complete(req(prompt(e.max_context), 1))


def test_cache_full_is_a_clear_error() -> None:
    e = Engine(opts(None, cache_pages=2))
    with pytest.raises(CacheFullError):
        e.complete(req(prompt(3 * C), 1))
    # and the engine still works afterwards: nothing leaked
    assert e.complete(req(prompt(C), 1)).tokens
    assert e.pool.free_count + e.prefix.evictable == 2


def test_remote_chunks_after_a_local_gap_reuse_nothing_twice(tmp_path: Path) -> None:
    """Chunk 1 gone locally, chunk 2 still cached: the lookup for chunks 1.. also returns
    chunk 2, which must be taken without registering its fingerprint a second time."""
    a = Engine(opts(tmp_path, write_policy="write-through"))
    p = prompt(3 * C + 4, 21)
    a.complete(req(p, 1))
    assert a.uploader is not None and a.uploader.drain(10)
    b = Engine(opts(tmp_path, cost_model=False))  # tiny recomputes faster than it pulls
    first = b.complete(req(p, 6))
    fps = b._fps(p, "default")
    gone = b.prefix._by_fp.pop(fps[1])  # as if evicted while chunk 2 stayed
    b.prefix._lru.pop(fps[1], None)
    b.pool.release(gone.page)
    again = b.complete(req(p, 6))
    assert again.tokens == first.tokens
    assert again.tokens_local == C and again.tokens_remote == 2 * C


def test_int8_workers_share_with_each_other_and_never_with_lossless(tmp_path: Path) -> None:
    """KVCLOUD_KV_CODEC=int8: pushes are ~half the bytes; another int8 worker restores them;
    a lossless worker on the same store and index never gets them, and its own pushes
    restore bit for bit as before."""
    long = prompt(4 * C + 3, 21)
    a = Engine(opts(tmp_path, kv_codec="int8", write_policy="write-through"))
    a.complete(req(long, 2))
    assert a.uploader is not None and a.uploader.drain(10)
    with KVCloud.open(store=a.options.store, index=a.options.index) as kv:
        sizes = [i.size for i in kv.store.list()]
    assert len(sizes) == 4
    ns = a.ns
    assert ns.quant == "int8"
    elems = ns.num_layers * 2 * C * ns.num_kv_heads * ns.head_dim
    payload = elems + 4 * elems // ns.head_dim  # 1 B an element, a float32 scale a head
    assert payload < ns.chunk_bytes  # float16 pages: 2 B an element
    assert all(payload < s < payload + 400 for s in sizes)  # plus the header

    exact = Engine(opts(tmp_path))
    assert exact.ns.id != ns.id
    r = exact.complete(req(long, 2))
    assert r.tokens_remote == 0 and r.tokens_computed == len(long)

    b = Engine(opts(tmp_path, kv_codec="int8"))
    r = b.complete(req(long, 2))
    assert r.tokens_remote == 4 * C

    # the restored pages hold the dequantized KV: close to, but not, the exact pages
    def page(e: Engine) -> torch.Tensor:
        cp = e.prefix.get(e._fps(long, "default")[0])
        assert cp is not None
        return e.pool.data[cp.page].float()

    got, want = page(b), page(exact)
    assert not torch.equal(got, want)
    # within half a quantization step (of each token's head) plus the float16 rounding
    step = want.abs().amax(dim=-1, keepdim=True) / 127
    assert ((got - want).abs() <= 0.5 * step + 1e-3 * want.abs()).all()
