"""The vLLM connector's worker side without vLLM: asynchronous restores from a real file
store into paged caches laid out like vLLM's CPU backend, reported as vLLM polls for them.

Checked: what is written is bit for bit what was pushed, through vLLM's block ids (out of
order, some held by vLLM already, the null block of a sliding window skipped); no byte that
fails verification reaches the cache (DESIGN §4.3: layers are written as each is verified),
and a chunk that fails and every chunk after it are reported for recompute in the pass that
reports the restore finished; a restore past
``load_timeout`` is abandoned and can no longer touch vLLM's blocks; a failing store opens the
breaker, which refuses loads at once and tells the scheduler side; the staging memory is
reused. A restore in the step (``load_mode=sync``, or ``auto`` when short) is read by the
forward pass layer by layer: each layer is in vLLM's blocks when the pass asks for it
(``wait_for_layer_load``), while later layers may still be in flight.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcloud import KVCloud  # noqa: E402
from kvcloud.integrations.vllm.config import VLLMConnectorConfig  # noqa: E402
from kvcloud.integrations.vllm.layout import learn_layout  # noqa: E402
from kvcloud.integrations.vllm.specs import KVCloudWorkerMeta, LoadChunk, LoadSpec  # noqa: E402
from kvcloud.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.helpers import make_kv, make_ns, make_tokens, same_bits  # noqa: E402
from tests.unit.test_vllm_layout import cpu_write, layer_for  # noqa: E402

BS = 8  # vLLM block size: two blocks per 16-token chunk
N_BLOCKS = 12
N_CHUNKS = 4


def setup(
    tmp_path: Path, block_ids: list[list[int]] | None = None, **cfg: object
) -> tuple[WorkerSide, KVCloud, np.ndarray, LoadSpec]:
    ns = make_ns("float32")  # 2 layers, 2 heads × 8, 16-token chunks
    c = ns.chunk_tokens
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    tokens = make_tokens(N_CHUNKS * c)
    kv = make_kv(ns, len(tokens))
    kvc.push(ns, tokens, kv)
    m = kvc.lookup(ns, tokens)
    assert m.tokens == len(tokens)
    config = VLLMConnectorConfig(write_policy="off", **cfg)  # type: ignore[arg-type]
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    ws = WorkerSide(config, ns, kvc, vllm_config, SimpleNamespace(num_blocks=N_BLOCKS))
    write = layer_for(cpu_write)
    for layer in range(ns.num_layers):
        name = f"model.layers.{layer}.self_attn.attn"
        cache = torch.zeros(N_BLOCKS, ns.num_kv_heads, BS, 2 * ns.head_dim)
        ws.caches[name] = cache
        ws.layer_index[name] = layer
        ws.layouts[name] = learn_layout(write, cache, N_BLOCKS, BS, ns.num_kv_heads, ns.head_dim)
    # blocks out of order, and the first block already held by vLLM (-1: left alone)
    block_ids = block_ids or [[-1, 11], [3, 2], [7, 8], [1, 4]]
    chunks = [
        LoadChunk(ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, ids)
        for ref, ids in zip(m.chunks, block_ids, strict=True)
    ]
    return ws, kvc, kv, LoadSpec("req-1", "default", chunks)


def hang_store(kvc: KVCloud) -> threading.Event:
    """Every object read waits until the returned event is set (a hung store)."""
    gate = threading.Event()
    real_open = kvc.store.open_read

    def hung_open(key: str):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return real_open(key)

    kvc.store.open_read = hung_open  # type: ignore[method-assign]
    return gate


def finish(ws: WorkerSide, req_id: str, timeout: float = 30.0) -> set[int]:
    """What vLLM does after each step until the restore is reported: ask what finished,
    then which blocks failed (in that order, as the model runner does)."""
    deadline = time.monotonic() + timeout
    while True:
        _, done = ws.get_finished(set())
        failed = ws.get_block_ids_with_load_errors()
        if done and req_id in done:
            return failed
        assert not failed, "failed blocks reported before the restore was"
        assert time.monotonic() < deadline, "the restore was never reported"
        time.sleep(0.002)


def step(ws: WorkerSide, spec: LoadSpec) -> set[int]:
    """One asynchronous restore, start to report."""
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    ws.wait_for_save()
    return finish(ws, spec.req_id)


def forward(ws: WorkerSide, after_layer=None) -> None:  # type: ignore[no-untyped-def]
    """What vLLM's forward pass does with a restore in the step: before each attention layer
    reads its blocks it waits for that layer (then ``after_layer(name)`` looks at them)."""
    for name in sorted(ws.layer_index, key=ws.layer_index.__getitem__):
        ws.wait_for_layer_load(name)
        if after_layer is not None:
            after_layer(name)


def assert_blocks_hold(
    ws: WorkerSide, kv: np.ndarray, spec: LoadSpec, chunks: range, only: str | None = None
) -> None:
    c = ws.ns.chunk_tokens
    for name, layer in ws.layer_index.items():
        if only is not None and name != only:
            continue
        cache, layout = ws.caches[name], ws.layouts[name]
        for i in chunks:
            for k, b in enumerate(spec.chunks[i].block_ids):
                if b < 0:
                    continue
                want = kv[layer, :, i * c + k * BS : i * c + (k + 1) * BS]
                assert same_bits(layout.gather(cache, [b]).numpy(), np.ascontiguousarray(want))


def test_a_restore_writes_every_layer_bit_exact(tmp_path: Path) -> None:
    ws, _, kv, spec = setup(tmp_path)
    untouched = [c.clone() for c in ws.caches.values()]
    assert step(ws, spec) == set()
    assert_blocks_hold(ws, kv, spec, range(N_CHUNKS))
    # block ids no chunk named (and the -1 slice) are left as they were
    named = {b for ch in spec.chunks for b in ch.block_ids if b >= 0}
    for cache, before in zip(ws.caches.values(), untouched, strict=True):
        for b in set(range(N_BLOCKS)) - named:
            assert torch.equal(cache[b], before[b])
    stats = ws.take_stats()
    assert stats["loaded_tokens"] == (2 * N_CHUNKS - 1) * BS
    assert stats.get("load_failed_blocks", 0) == 0
    # the timings a benchmark splits a restore's cost by: writing is part of the restore,
    # and an asynchronous restore is reported after it ended, never before
    assert stats["loads"] == 1
    assert 0 < stats["load_write_us"] <= stats["load_us"]
    assert "load_report_us" in stats


@pytest.mark.parametrize("how", ["bitflip", "deleted"])
def test_a_bad_chunk_and_all_after_it_are_reported_in_the_same_step(
    tmp_path: Path, how: str
) -> None:
    ws, kvc, kv, spec = setup(tmp_path)
    key = spec.chunks[1].object_key
    data = bytearray(kvc.store.get(key))
    kvc.store.delete(key)
    if how == "bitflip":
        data[-100] ^= 0x01  # in the last layer: the chunk's first layers are intact
        kvc.store.put(key, bytes(data))
    failed = step(ws, spec)
    assert failed == {b for ch in spec.chunks[1:] for b in ch.block_ids}
    assert_blocks_hold(ws, kv, spec, range(1))
    # layers are written as they are verified (object format 3), so the reported blocks hold
    # verified KV or nothing, never a byte that failed: the flipped layer is not written
    c = ws.ns.chunk_tokens
    last = max(ws.layer_index.values())
    for name, layer in ws.layer_index.items():
        cache, layout = ws.caches[name], ws.layouts[name]
        for i in range(1, N_CHUNKS):
            for k, b in enumerate(spec.chunks[i].block_ids):
                got = layout.gather(cache, [b]).numpy()
                want = np.ascontiguousarray(kv[layer, :, i * c + k * BS : i * c + (k + 1) * BS])
                assert same_bits(got, want) or not got.any(), (name, i, b)
                if i == 1 and (how == "deleted" or layer == last):
                    assert not got.any(), (name, b)  # what failed never reached the cache
    stats = ws.take_stats()
    assert stats["load_failed_blocks"] == len(failed) and stats["loaded_tokens"] == BS


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_restore_past_its_deadline_is_abandoned_and_never_writes(tmp_path: Path) -> None:
    """A hung store: the restore is reported failed at its deadline, and when the pull ends
    later, nothing reaches vLLM's blocks (vLLM may have given them to another request)."""
    ws, kvc, _, spec = setup(tmp_path, load_timeout=1.0)
    clock = _Clock()
    ws._clock = clock
    gate = hang_store(kvc)
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    assert ws.get_finished(set()) == (None, None)  # still pulling, deadline not reached
    clock.t += 1.5
    _, done = ws.get_finished(set())
    assert done == {spec.req_id}
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks for b in ch.block_ids if b >= 0
    }
    gate.set()
    ws._pool.shutdown(wait=True)
    for cache in ws.caches.values():
        assert not cache.any(), "an abandoned restore wrote into vLLM's blocks"
    stats = ws.take_stats()
    assert stats["load_timeouts"] == 1
    assert ws.store_breaker.is_open  # one timeout is enough: the next request is spared it
    # the object is remembered: the scheduler side hears of it
    meta = ws.build_worker_meta()
    assert meta is not None and spec.chunks[0].object_key in meta.bad_objects


def test_a_failing_store_opens_the_breaker_and_loads_are_refused_at_once(
    tmp_path: Path,
) -> None:
    from kvcloud.errors import StoreUnavailableError

    ws, kvc, kv, spec = setup(tmp_path, breaker_failures=2, breaker_backoff=5.0)
    clock = _Clock()
    ws._clock = clock
    ws.store_breaker._clock = clock
    calls = []
    real_open = kvc.store.open_read

    def refused(key: str):  # type: ignore[no-untyped-def]
        calls.append(key)
        raise StoreUnavailableError("connection refused")

    kvc.store.open_read = refused  # type: ignore[method-assign]
    every = {b for ch in spec.chunks for b in ch.block_ids if b >= 0}
    for i in range(2):
        spec.req_id = f"r{i}"
        ws._bad_objects.clear()  # a fresh failure each time, not the remembered one
        assert step(ws, spec) == every
    assert ws.store_breaker.is_open
    meta = ws.build_worker_meta()
    assert meta is not None and meta.store_retry_in > 0 and not meta.store_ok
    n = len(calls)
    spec.req_id = "r-refused"
    ws._bad_objects.clear()
    t0 = time.perf_counter()
    assert step(ws, spec) == every
    assert time.perf_counter() - t0 < 0.05
    assert len(calls) == n, "the open breaker let a load reach the store"
    assert ws.take_stats()["store_breaker_open"] == 1
    # after the backoff one probe goes; the store is back, so it closes
    kvc.store.open_read = real_open  # type: ignore[method-assign]
    clock.t += 6
    spec.req_id = "r-probe"
    ws._bad_objects.clear()
    assert step(ws, spec) == set()
    assert not ws.store_breaker.is_open
    assert_blocks_hold(ws, kv, spec, range(N_CHUNKS))
    meta = ws.build_worker_meta()
    assert meta is not None and meta.store_ok


def test_the_null_block_of_a_sliding_window_is_never_written(tmp_path: Path) -> None:
    # chunk 0 is out of the window: both its blocks are vLLM's null block (id 0)
    ws, _, kv, spec = setup(tmp_path, block_ids=[[0, 0], [3, 2], [7, 8], [1, 4]])
    assert step(ws, spec) == set()
    for cache in ws.caches.values():
        assert not cache[0].any()
    assert_blocks_hold(ws, kv, spec, range(1, N_CHUNKS))
    assert ws.take_stats()["loaded_tokens"] == 6 * BS


def test_staging_is_reused_and_stays_correct(tmp_path: Path) -> None:
    ws, _, kv, spec = setup(tmp_path, staging_mib=1)
    assert step(ws, spec) == set()
    kept = ws._kept
    assert kept is not None
    for cache in ws.caches.values():
        cache.zero_()
    assert step(ws, spec) == set()
    assert ws._kept is kept  # no fresh memory for the same restore
    assert_blocks_hold(ws, kv, spec, range(N_CHUNKS))
    # a restore that does not fit the cap gets memory of its own, correctly filled
    small, *_ = setup(tmp_path / "small", staging_mib=0)
    assert step(small, spec) == set() and small._kept is None


def test_a_sync_restore_is_written_before_the_forward_pass(tmp_path: Path) -> None:
    """``load_mode=sync``: each layer's blocks are written when the forward pass asks for
    that layer, and the restore is never reported as an asynchronous one."""
    ws, _, kv, spec = setup(tmp_path, load_mode="sync")
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws, lambda name: assert_blocks_hold(ws, kv, spec, range(N_CHUNKS), only=name))
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == set()
    stats = ws.take_stats()
    assert stats["loaded_tokens"] == (2 * N_CHUNKS - 1) * BS
    assert stats["loads"] == 1 and stats["load_us"] > 0
    assert "load_report_us" not in stats  # a sync restore is never waited on to be reported


class _GatedReader:
    """A store read that delivers ``allow`` bytes, then waits for ``gate``: an object whose
    last layer is still on the wire."""

    def __init__(self, inner, allow: int, gate: threading.Event) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.left, self.gate = inner, allow, gate

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()

    def _room(self, n: int) -> int:
        if self.left <= 0:
            assert self.gate.wait(10)
            return n
        return min(n, self.left) if n >= 0 else self.left

    def read(self, n: int = -1) -> bytes:
        got = self.inner.read(self._room(n))
        self.left -= len(got)
        return got

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        view = memoryview(buf).cast("B")
        got = self.inner.readinto(view[: self._room(len(view))]) or 0
        self.left -= got
        return got


def test_the_forward_pass_reads_layer_0_while_layer_1_is_in_flight(tmp_path: Path) -> None:
    """Verified layer-wise streaming into vLLM's blocks: with every object's last layer held
    back, the pass gets layer 0 of every chunk, verified and written; layer 1 comes once the
    bytes do. (Before object format 3, nothing was written before every byte was in.)"""
    ws, kvc, kv, spec = setup(tmp_path, load_mode="sync", load_timeout=20.0)
    layer_bytes = 2 * ws.ns.chunk_tokens * ws.ns.num_kv_heads * ws.ns.head_dim * 4
    gate = threading.Event()
    real_open = kvc.store.open_read

    def gated_open(key: str) -> _GatedReader:
        size = kvc.store.head(key).size  # type: ignore[union-attr]
        return _GatedReader(real_open(key), size - layer_bytes, gate)

    kvc.store.open_read = gated_open  # type: ignore[method-assign]
    # as many chunks as the store pulls at once (here 2): a chunk past them waits for a
    # connection, so its layer 0 comes after an earlier chunk's last layer
    spec = dataclasses.replace(spec, chunks=spec.chunks[: kvc.store.max_workers])
    names = sorted(ws.layer_index, key=ws.layer_index.__getitem__)
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    t0 = time.monotonic()
    ws.wait_for_layer_load(names[0])
    assert time.monotonic() - t0 < 5.0  # did not wait for the held-back bytes
    assert_blocks_hold(ws, kv, spec, range(len(spec.chunks)), only=names[0])
    blocks = sorted({b for ch in spec.chunks for b in ch.block_ids if b >= 0})
    assert not ws.caches[names[1]][blocks].any()  # layer 1 is still on the wire
    gate.set()
    ws.wait_for_layer_load(names[1])
    assert_blocks_hold(ws, kv, spec, range(len(spec.chunks)), only=names[1])
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == set()


def test_a_sync_restore_reports_a_bad_chunk_after_the_same_step(tmp_path: Path) -> None:
    ws, kvc, kv, spec = setup(tmp_path, load_mode="sync")
    kvc.store.delete(spec.chunks[2].object_key)
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks[2:] for b in ch.block_ids
    }
    assert_blocks_hold(ws, kv, spec, range(2))


def test_a_hung_sync_restore_stalls_the_step_no_longer_than_load_timeout(tmp_path: Path) -> None:
    ws, kvc, _, spec = setup(tmp_path, load_mode="sync", load_timeout=0.3)
    gate = hang_store(kvc)
    t0 = time.monotonic()
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks for b in ch.block_ids if b >= 0
    }
    gate.set()
    ws._pool.shutdown(wait=True)
    for cache in ws.caches.values():
        assert not cache.any(), "an abandoned restore wrote into vLLM's blocks"


def test_an_auto_restore_in_the_step_stalls_it_at_most_four_budgets(tmp_path: Path) -> None:
    """``load_mode=auto``: a restore the scheduler put in the step waits there no longer than
    four ``sync_budget_ms`` (not ``load_timeout``), is then recomputed and never writes; one
    it left beside the pass is not waited for at all."""
    ws, kvc, _, spec = setup(tmp_path, load_mode="auto", sync_budget_ms=75, load_timeout=5.0)
    gate = hang_store(kvc)
    spec.sync = True
    t0 = time.monotonic()
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    assert 0.28 < time.monotonic() - t0 < 1.5
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks for b in ch.block_ids if b >= 0
    }
    assert ws.take_stats()["load_timeouts"] == 1
    gate.set()
    ws._pool.shutdown(wait=True)
    for cache in ws.caches.values():
        assert not cache.any(), "an abandoned restore wrote into vLLM's blocks"
    beside, *_ = setup(tmp_path / "beside", load_mode="auto", sync_budget_ms=75)
    gate = hang_store(beside.client)
    spec.sync, spec.req_id = False, "beside"
    t0 = time.monotonic()
    beside.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.2
    assert beside.get_finished(set()) == (None, None)
    gate.set()
    assert finish(beside, "beside") == set()


def test_restores_report_their_rate_to_the_scheduler_side(tmp_path: Path) -> None:
    """What ``load_mode=auto`` decides from: the bytes and seconds of the restores that
    ended, in the step and beside it, each reported once."""
    ws, _, _, spec = setup(tmp_path, load_mode="auto")
    assert ws.build_worker_meta() is None
    step(ws, spec)  # beside the pass
    meta = ws.build_worker_meta()
    assert meta is not None
    size = sum(ch.size for ch in spec.chunks)
    assert meta.beside_bytes == size and meta.beside_s > 0
    assert meta.in_step_bytes == 0 and meta.in_step_s == 0
    assert ws.build_worker_meta() is None  # reported once
    spec.sync, spec.req_id = True, "in-step"
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    ws.get_finished(set())
    meta = ws.build_worker_meta()
    assert meta is not None and meta.in_step_bytes == size and meta.in_step_s > 0
    assert meta.beside_bytes == 0
    # two ranks' reports add up (vLLM aggregates the workers' metadata)
    other = KVCloudWorkerMeta(in_step_bytes=10, in_step_s=1.0, beside_bytes=5, beside_s=2.0)
    total = meta.aggregate(other)
    assert (total.in_step_bytes, total.beside_bytes) == (size + 10, 5)
    assert total.beside_s == 2.0


def test_saves_copy_each_layer_into_pooled_buffers_and_push_what_vllm_computed(
    tmp_path: Path,
) -> None:
    """A step's saves: each layer's blocks copied right after the layer ran, the chunk
    pushed whole, read back bit for bit (a plain pull), and its buffer reused next step."""
    from kvcloud.integrations.vllm.specs import SaveChunk, SaveSpec

    ns = make_ns("float32")
    c = ns.chunk_tokens
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    config = VLLMConnectorConfig(write_policy="write-through")
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    ws = WorkerSide(config, ns, kvc, vllm_config, SimpleNamespace(num_blocks=N_BLOCKS))
    write = layer_for(cpu_write)
    tokens = [int(t) for t in make_tokens(2 * c)]
    kv = make_kv(ns, len(tokens))
    fps = kvc.fingerprints(ns, tokens)
    ids = [[5, 2], [9, 10]]  # out of order, then a run
    names = []
    for layer in range(ns.num_layers):
        name = f"model.layers.{layer}.self_attn.attn"
        cache = torch.zeros(N_BLOCKS, ns.num_kv_heads, BS, 2 * ns.head_dim)
        layout = learn_layout(write, cache, N_BLOCKS, BS, ns.num_kv_heads, ns.head_dim)
        for i, chunk_ids in enumerate(ids):
            layout.scatter(cache, chunk_ids, torch.from_numpy(kv[layer, :, i * c : (i + 1) * c]))
        ws.caches[name], ws.layer_index[name], ws.layouts[name] = cache, layer, layout
        names.append(name)

    def run_step(chunks: list[SaveChunk]) -> None:
        meta = SimpleNamespace(loads=[], saves=[SaveSpec("r1", "default", chunks)])
        for name in names:
            ws.save_kv_layer(meta, name, ws.caches[name])  # type: ignore[arg-type]
        ws.wait_for_save()

    run_step([SaveChunk(0, fps[0], ns.digest, ids[0])])
    deadline = time.monotonic() + 10
    while len(ws._buffers._free) < 1:  # given back once pushed
        assert time.monotonic() < deadline, "the buffer never came back from the uploader"
        time.sleep(0.005)
    reused = ws._buffers._free[0]
    run_step([SaveChunk(1, fps[1], fps[0], ids[1])])
    while len(ws._buffers._free) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert ws._buffers._free[0] is reused  # the same memory served the second save
    m = kvc.lookup(ns, tokens)
    assert m.tokens == 2 * c
    assert same_bits(kvc.pull(m), kv)
    stats = ws.take_stats()
    assert stats["chunks_pushed"] == 2
    assert stats["save_us"] > 0  # the copies on the forward thread, timed
    ws.shutdown()
