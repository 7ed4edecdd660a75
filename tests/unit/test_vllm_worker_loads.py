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
(``wait_for_layer_load``), while later layers may still be in flight; where full CUDA graphs
may replay a step (no per-layer hook runs) it is whole before ``start_load_kv`` returns, and
saves are copied in ``wait_for_save``, never in a per-layer hook. Restores in the step never
queue behind restores beside it, and a restore that timed out queued on this worker is not
blamed on the store.

Timing bounds are kept out of these tests (they run on a shared 2-core machine): what is
asserted is behaviour (counts, order, that a wait ended because what it waited for happened
or because its deadline passed); how fast it is belongs to scripts/bench/bench_vllm_*.py.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcloud import KVCloud  # noqa: E402
from kvcloud.integrations.vllm.config import VLLMConnectorConfig  # noqa: E402
from kvcloud.integrations.vllm.expiring import Expiring  # noqa: E402
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


def meta(*specs: LoadSpec, saves: list | None = None) -> SimpleNamespace:
    """The connector metadata of one step."""
    return SimpleNamespace(loads=list(specs), saves=saves or [])


def gate_keys(kvc: KVCloud, keys: list[str]) -> tuple[dict[str, threading.Event], ...]:
    """Reads of each of ``keys`` wait until its gate is set; ``entered[key]`` is set once a
    read of it began, and ``reads`` counts every read by key (gated or not)."""
    gates = {key: threading.Event() for key in keys}
    entered = {key: threading.Event() for key in keys}
    reads: dict[str, int] = {}
    real_open = kvc.store.open_read

    def gated_open(key: str):  # type: ignore[no-untyped-def]
        reads[key] = reads.get(key, 0) + 1
        if key in gates:
            entered[key].set()
            assert gates[key].wait(30)
        return real_open(key)

    kvc.store.open_read = gated_open  # type: ignore[method-assign]
    return gates, entered, reads  # type: ignore[return-value]


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
            at = spec.chunks[i].position * c  # the chunk's first token in the prompt
            for k, b in enumerate(spec.chunks[i].block_ids):
                if b < 0:
                    continue
                want = kv[layer, :, at + k * BS : at + (k + 1) * BS]
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
    layers_in: list[tuple[int, int]] = []
    real_pull = kvc.pull_into

    def counted_pull(*args, on_layer, **kwargs):  # type: ignore[no-untyped-def]
        def seen(i: int, layer: int) -> None:
            layers_in.append((i, layer))
            on_layer(i, layer)

        return real_pull(*args, on_layer=seen, **kwargs)

    kvc.pull_into = counted_pull  # type: ignore[method-assign]
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
    # each chunk's read that was under way (waiting on the hung store) stopped at the first
    # layer that came in, and one not started never started: no layer 1 was read (before,
    # every layer of every chunk was pulled and thrown away)
    assert layers_in and all(layer == 0 for _, layer in layers_in), layers_in
    stats = ws.take_stats()
    assert stats["pulls_stopped"] == 1
    assert stats["load_timeouts"] == 1
    assert ws.store_breaker.is_open  # one timeout is enough: the next request is spared it
    # the object is remembered: the scheduler side hears of it
    meta = ws.build_worker_meta()
    assert meta is not None and spec.chunks[0].object_key in meta.bad_objects
    # and the cost guard hears what the store delivered in the 1.5 s it had: nothing
    assert meta.given_up_bytes == 0
    assert meta.given_up_s == pytest.approx(1.5)


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
        ws._bad_objects = Expiring()  # a fresh failure each time, not the remembered one
        assert step(ws, spec) == every
    assert ws.store_breaker.is_open
    meta = ws.build_worker_meta()
    assert meta is not None and meta.store_retry_in > 0 and not meta.store_ok
    n = len(calls)
    spec.req_id = "r-refused"
    ws._bad_objects = Expiring()
    assert step(ws, spec) == every
    assert len(calls) == n, "the open breaker let a load reach the store"
    stats = ws.take_stats()
    assert stats["store_breaker_open"] == 1 and stats["loads_refused"] == 1
    # after the backoff one probe goes; the store is back, so it closes
    kvc.store.open_read = real_open  # type: ignore[method-assign]
    clock.t += 6
    spec.req_id = "r-probe"
    ws._bad_objects = Expiring()
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


def test_staging_is_one_bounded_ring_reused_by_every_restore(tmp_path: Path) -> None:
    """Restores stream through one ring of ``staging_mib`` (at least one chunk), allocated
    once: a restore larger than the ring pulls its chunks in groups through the same slots,
    bit for bit, and restores in the step (one thread per chunk) share it too (defect 7:
    before, every step allocated staging for all of its restores, on the forward thread)."""
    ws, _kvc, kv, spec = setup(tmp_path, staging_mib=1)  # 1 MiB: room for every chunk here
    assert step(ws, spec) == set()
    ring = ws._ring
    assert ring is not None and ring.slots >= N_CHUNKS
    buf = ring._buf
    for cache in ws.caches.values():
        cache.zero_()
    assert step(ws, spec) == set()
    assert ws._ring is ring and ring._buf is buf  # no fresh memory for the next restore
    assert_blocks_hold(ws, kv, spec, range(N_CHUNKS))
    # a ring of one chunk: four chunks through one slot, one after another, still bit-exact
    small, _, kv2, spec2 = setup(tmp_path / "small", staging_mib=0)
    opened: list[str] = []
    real_open = small.client.store.open_read

    def seen_open(key: str):  # type: ignore[no-untyped-def]
        opened.append(key)
        return real_open(key)

    small.client.store.open_read = seen_open  # type: ignore[method-assign]
    assert step(small, spec2) == set()
    ring2 = small._ring
    assert ring2 is not None and ring2.slots == 1
    assert ring2.allocated_bytes == math.prod(small._chunk_shape) * 4  # float32: one chunk
    assert opened == [ch.object_key for ch in spec2.chunks]  # in order, one at a time
    assert_blocks_hold(small, kv2, spec2, range(N_CHUNKS))
    # in the step: a thread per chunk, all through the one slot
    for cache in small.caches.values():
        cache.zero_()
    sync = LoadSpec(spec2.req_id, spec2.tenant, spec2.chunks, sync=True)
    small.start_load_kv(meta(sync))  # type: ignore[arg-type]
    forward(small)
    small.wait_for_save()
    small.get_finished(set())
    assert small.get_block_ids_with_load_errors() == set()
    assert_blocks_hold(small, kv2, sync, range(N_CHUNKS))
    assert ring2._free == [0]  # every slot given back


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
    ws.wait_for_layer_load(names[0])
    # the wait ended because layer 0 was written, not at the deadline: nothing timed out,
    # and the held-back bytes are still held back
    assert "load_timeouts" not in ws.take_stats() and not gate.is_set()
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


def test_a_hung_sync_restore_is_given_up_at_its_deadline(tmp_path: Path) -> None:
    ws, kvc, _, spec = setup(tmp_path, load_mode="sync", load_timeout=0.3)
    gate = hang_store(kvc)
    t0 = time.monotonic()
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    # the step waited until the deadline (never less), then gave the restore up: counted as
    # a timeout, its blocks reported for recompute
    assert time.monotonic() - t0 >= 0.3
    assert ws.take_stats()["load_timeouts"] == 1
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
    ws, kvc, _, spec = setup(tmp_path, load_mode="auto", sync_budget_ms=75, load_timeout=60.0)
    gate = hang_store(kvc)
    spec.sync = True
    t0 = time.monotonic()
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    # the deadline was four budgets (0.3 s), not load_timeout (60 s): the bound tells the
    # two apart with a margin no loaded machine eats
    assert 0.3 <= time.monotonic() - t0 < 30
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
    beside.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    # start_load_kv returned while the store still holds every read: it did not wait
    assert not gate.is_set() and beside.get_finished(set()) == (None, None)
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
    # and to vLLM's metrics: one restore beside the pass, its time and bytes (histograms)
    stats = ws.take_stats()
    assert stats["restore_seconds"] == [pytest.approx(meta.beside_s)]
    assert stats["restore_bytes"] == [size] and "restore_in_step_seconds" not in stats
    assert stats.get("restores_in_flight", 0) == 0  # it ended
    spec.sync, spec.req_id = True, "in-step"
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    forward(ws)
    ws.get_finished(set())
    meta = ws.build_worker_meta()
    assert meta is not None and meta.in_step_bytes == size and meta.in_step_s > 0
    assert meta.beside_bytes == 0
    stats = ws.take_stats()
    assert stats["restore_in_step_seconds"] == [pytest.approx(meta.in_step_s)]
    assert "restore_seconds" not in stats
    # two ranks' reports add up (vLLM aggregates the workers' metadata)
    other = KVCloudWorkerMeta(in_step_bytes=10, in_step_s=1.0, beside_bytes=5, beside_s=2.0)
    total = meta.aggregate(other)
    assert (total.in_step_bytes, total.beside_bytes) == (size + 10, 5)
    assert total.beside_s == 2.0


def saver(tmp_path: Path, **cfg: object) -> tuple[WorkerSide, KVCloud, np.ndarray, list]:
    """A worker side that saves, its caches holding two chunks of KV as vLLM's forward pass
    left them (blocks out of order, then a run); returns it, its client, the KV and the
    chunks' fingerprints."""
    ns = make_ns("float32")
    c = ns.chunk_tokens
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    config = VLLMConnectorConfig(write_policy="write-through", **cfg)  # type: ignore[arg-type]
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    ws = WorkerSide(config, ns, kvc, vllm_config, SimpleNamespace(num_blocks=N_BLOCKS))
    write = layer_for(cpu_write)
    tokens = [int(t) for t in make_tokens(2 * c)]
    kv = make_kv(ns, len(tokens))
    for layer in range(ns.num_layers):
        name = f"model.layers.{layer}.self_attn.attn"
        cache = torch.zeros(N_BLOCKS, ns.num_kv_heads, BS, 2 * ns.head_dim)
        layout = learn_layout(write, cache, N_BLOCKS, BS, ns.num_kv_heads, ns.head_dim)
        for i, chunk_ids in enumerate(SAVE_IDS):
            layout.scatter(cache, chunk_ids, torch.from_numpy(kv[layer, :, i * c : (i + 1) * c]))
        ws.caches[name], ws.layer_index[name], ws.layouts[name] = cache, layer, layout
    return ws, kvc, kv, kvc.fingerprints(ns, tokens)


SAVE_IDS = [[5, 2], [9, 10]]


def hookless_step(ws: WorkerSide, step_meta: SimpleNamespace) -> None:
    """A step as a full CUDA graph replay runs it: vLLM's per-layer hooks
    (``wait_for_layer_load``, ``save_kv_layer``) live in a Python wrapper the replay never
    executes, so the connector sees ``start_load_kv``, then the calls after the pass."""
    ws.start_load_kv(step_meta)  # type: ignore[arg-type]
    ws.wait_for_save()
    ws.get_finished(set())
    ws.get_block_ids_with_load_errors()


def test_a_step_without_per_layer_hooks_saves_what_vllm_computed(tmp_path: Path) -> None:
    """A decode-only step under a full CUDA graph calls no ``save_kv_layer``: the chunks it
    filled are still copied (in ``wait_for_save``, after the pass) into pooled buffers, pushed
    whole, read back bit for bit, and a buffer is reused the next step."""
    from kvcloud.integrations.vllm.specs import SaveChunk, SaveSpec

    ws, kvc, kv, fps = saver(tmp_path)
    ns = ws.ns

    def run_step(chunks: list[SaveChunk]) -> None:
        hookless_step(ws, meta(saves=[SaveSpec("r1", "default", chunks)]))

    run_step([SaveChunk(0, fps[0], ns.digest, SAVE_IDS[0])])
    deadline = time.monotonic() + 30
    while len(ws._buffers._free) < 1:  # given back once pushed
        assert time.monotonic() < deadline, "the buffer never came back from the uploader"
        time.sleep(0.005)
    reused = ws._buffers._free[0]
    run_step([SaveChunk(1, fps[1], fps[0], SAVE_IDS[1])])
    while len(ws._buffers._free) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert ws._buffers._free[0] is reused  # the same memory served the second save
    m = kvc.lookup(ns, [int(t) for t in make_tokens(2 * ns.chunk_tokens)])
    assert m.tokens == 2 * ns.chunk_tokens
    assert same_bits(kvc.pull(m), kv)
    stats = ws.take_stats()
    assert stats["chunks_queued"] == 2 and stats["chunks_pushed"] == 2
    assert stats.get("saves_skipped", 0) == 0
    assert stats["save_us"] > 0  # the copies on the forward thread, timed
    ws.shutdown()


def test_a_stage_whose_wait_for_save_vllm_defers_still_saves(tmp_path: Path) -> None:
    """V1 with speculative decoding defers ``wait_for_save`` until after the drafter, and a
    pipeline stage other than the last returns before it (``gpu_model_runner``): the step's
    chunks are copied in ``get_finished``, still in the step, not skipped at the next one."""
    from kvcloud.integrations.vllm.specs import SaveChunk, SaveSpec

    ws, kvc, kv, fps = saver(tmp_path)
    ns = ws.ns
    for i in range(2):  # two steps, neither calls wait_for_save
        chunk = SaveChunk(i, fps[i], fps[i - 1] if i else ns.digest, SAVE_IDS[i])
        ws.start_load_kv(meta(saves=[SaveSpec("r1", "default", [chunk])]))  # type: ignore[arg-type]
        ws.get_finished(set())
        ws.get_block_ids_with_load_errors()
    ws.wait_for_save()  # a late finalize finds nothing left to copy twice
    assert ws.uploader is not None
    ws.uploader.close()
    stats = ws.take_stats()
    assert stats.get("saves_skipped", 0) == 0
    assert stats["chunks_queued"] == 2 and stats["chunks_pushed"] == 2
    m = kvc.lookup(ns, [int(t) for t in make_tokens(2 * ns.chunk_tokens)])
    assert m.tokens == 2 * ns.chunk_tokens
    assert same_bits(kvc.pull(m), kv)
    ws.shutdown()


def test_a_chunk_named_for_saving_is_offered_or_counted_never_dropped(tmp_path: Path) -> None:
    """Every chunk the scheduler names is offered to the uploader (then pushed, or counted
    as ``upload_dropped``) or counted as ``saves_skipped``: one partly out of a sliding
    window (the null block), one whose blocks cannot be read; per-layer hooks or not."""
    from kvcloud.integrations.vllm.specs import NULL_BLOCK, SaveChunk, SaveSpec

    ws, kvc, _, fps = saver(tmp_path)
    ns = ws.ns
    good = SaveChunk(0, fps[0], ns.digest, SAVE_IDS[0])
    windowed = SaveChunk(1, fps[1], fps[0], [NULL_BLOCK, SAVE_IDS[1][1]])
    unreadable = SaveChunk(1, fps[1], fps[0], [9, N_BLOCKS + 40])  # past the cache's end
    hookless_step(ws, meta(saves=[SaveSpec("r1", "default", [good, windowed, unreadable])]))
    assert ws.uploader is not None
    ws.uploader.close()  # waits for the queue to drain
    stats = ws.take_stats()
    assert stats["chunks_queued"] == 1 and stats["chunks_pushed"] == 1
    assert stats["saves_skipped"] == 2
    assert kvc.lookup(ns, [int(t) for t in make_tokens(2 * ns.chunk_tokens)]).tokens == (
        ns.chunk_tokens
    )
    ws.shutdown()


def test_a_full_upload_queue_costs_no_copy(tmp_path: Path) -> None:
    """On a sick store the upload queue fills: a chunk the queue cannot take is counted as
    dropped without being copied out of vLLM's blocks (the copy would be wasted work on the
    forward thread)."""
    from kvcloud.integrations.vllm.specs import SaveChunk, SaveSpec

    ws, _kvc, _, fps = saver(tmp_path, upload_queue=1)
    ns = ws.ns
    gate = threading.Event()
    put = ws.uploader.client.store.put  # type: ignore[union-attr]

    def held(key: str, data: object) -> bool:
        gate.wait(30)
        return put(key, data)

    ws.uploader.client.store.put = held  # type: ignore[union-attr,method-assign]
    taken: list[int] = []
    take = ws._buffers.take
    ws._buffers.take = lambda: taken.append(1) or take()  # type: ignore[method-assign]
    chunks = [SaveChunk(0, fps[0], ns.digest, SAVE_IDS[0])]
    hookless_step(ws, meta(saves=[SaveSpec("r1", "default", chunks)]))  # taken by the thread
    deadline = time.monotonic() + 30
    while ws.uploader.room() < 1:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    chunks2 = [SaveChunk(1, fps[1], fps[0], SAVE_IDS[1])]
    hookless_step(ws, meta(saves=[SaveSpec("r1", "default", chunks2)]))  # fills the queue
    hookless_step(ws, meta(saves=[SaveSpec("r2", "default", chunks2)]))  # no room: no copy
    assert len(taken) == 2
    stats = ws.take_stats()
    assert stats["upload_dropped"] == 1 and stats["chunks_queued"] == 2
    gate.set()
    ws.shutdown()


def test_full_cuda_graphs_are_read_from_vllms_compilation_config(tmp_path: Path) -> None:
    """Whether a step may be replayed by a full CUDA graph (so no per-layer hook runs):
    ``cudagraph_mode`` has full graphs and the model is not run eagerly."""

    class Mode:
        def __init__(self, full: bool) -> None:
            self.full = full

        def has_full_cudagraphs(self) -> bool:
            return self.full

    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db")

    def worker(mode: object, eager: bool) -> WorkerSide:
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BS),
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
            model_config=SimpleNamespace(enforce_eager=eager),
        )
        cfg = VLLMConnectorConfig(write_policy="off")
        return WorkerSide(cfg, make_ns("float32"), kvc, vllm_config, SimpleNamespace())

    assert worker(Mode(True), eager=False).full_graphs
    assert not worker(Mode(True), eager=True).full_graphs
    assert not worker(Mode(False), eager=False).full_graphs
    assert not worker(None, eager=False).full_graphs
    # vLLM's own CUDAGraphMode values: tests/vllm/test_vllm_config_checks.py


def test_with_full_cuda_graphs_an_in_step_restore_is_whole_before_the_pass(
    tmp_path: Path,
) -> None:
    """A full graph replays the pass without ``wait_for_layer_load``: so with full graphs
    on, ``start_load_kv`` returns only once the step's restore is written, verified, into
    every layer's blocks (the store here answers only after start_load_kv was called)."""
    ws, kvc, kv, spec = setup(tmp_path, load_mode="sync", load_timeout=60.0)
    ws.full_graphs = True
    gate = hang_store(kvc)
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    ws.start_load_kv(meta(spec))  # type: ignore[arg-type]
    # the replayed pass reads every layer now, with nothing in between
    assert_blocks_hold(ws, kv, spec, range(N_CHUNKS))
    ws.wait_for_save()
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == set()
    stats = ws.take_stats()
    assert stats["loaded_tokens"] == (2 * N_CHUNKS - 1) * BS
    assert "load_timeouts" not in stats
    opener.join()


def test_with_full_cuda_graphs_a_hung_in_step_restore_is_given_up_before_the_pass(
    tmp_path: Path,
) -> None:
    """The store hangs: ``start_load_kv`` returns at the restore's deadline, the restore
    already given up (so nothing is written under the pass's reads), its blocks reported
    for recompute after the step."""
    ws, kvc, _, spec = setup(tmp_path, load_mode="sync", load_timeout=0.3)
    ws.full_graphs = True
    gate = hang_store(kvc)
    ws.start_load_kv(meta(spec))  # type: ignore[arg-type]
    assert ws.take_stats()["load_timeouts"] == 1  # given up before the pass
    ws.wait_for_save()
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks for b in ch.block_ids if b >= 0
    }
    gate.set()
    ws._pool.shutdown(wait=True)
    for cache in ws.caches.values():
        assert not cache.any(), "an abandoned restore wrote into vLLM's blocks"


def test_an_in_step_restore_never_queues_behind_restores_beside_the_pass(
    tmp_path: Path,
) -> None:
    """Restores beside the pass hold every load thread and every store thread (their store
    hangs); a restore in the step still runs at once, on threads of its own, and is whole
    when the pass reads it, well before any deadline."""
    # load_mode=auto: each spec says where it runs; four budgets of 5 s is the in-step
    # deadline, so a restore that queued would stall the pass 20 s and then fail
    ws, kvc, kv, spec = setup(tmp_path, load_threads=1, sync_budget_ms=5000, load_timeout=20.0)
    beside = dataclasses.replace(spec, req_id="beside", chunks=spec.chunks[:2])
    in_step = dataclasses.replace(spec, req_id="in-step", chunks=spec.chunks[2:], sync=True)
    gates, entered, _ = gate_keys(kvc, [ch.object_key for ch in beside.chunks])
    ws.start_load_kv(meta(beside))  # type: ignore[arg-type]
    assert all(e.wait(30) for e in entered.values())  # both store threads hung in its reads
    ws.start_load_kv(meta(in_step))  # type: ignore[arg-type]
    forward(ws)
    assert ws.get_finished(set()) == (None, None)
    assert ws.get_block_ids_with_load_errors() == set()
    assert_blocks_hold(ws, kv, in_step, range(2))
    stats = ws.take_stats()
    assert "load_timeouts" not in stats and stats["loaded_tokens"] == 4 * BS
    # the gauge: the restore beside the pass is still in flight, the one in the step ended
    assert stats["restores_in_flight"] == 1
    for gate in gates.values():
        gate.set()
    assert finish(ws, "beside") == set()
    assert ws.take_stats()["restores_in_flight"] == 0  # sent once more: it changed


def test_a_restore_that_timed_out_queued_here_is_recomputed_but_not_blamed_on_the_store(
    tmp_path: Path,
) -> None:
    """One load thread, three restores beside the pass: the first takes most of its
    timeout, the second starts late, the third is still queued when its deadline (from
    submission) passes. The third is failed for its request, but the store never saw it:
    the breaker stays closed and its object is still offered. The second's deadline counts
    from its pull's start, so it is not given up at the third's."""
    ws, kvc, kv, spec = setup(tmp_path, load_threads=1, load_timeout=1.0)
    clock = _Clock()
    ws._clock = clock
    first = dataclasses.replace(spec, req_id="first", chunks=spec.chunks[:1])
    second = dataclasses.replace(spec, req_id="second", chunks=spec.chunks[1:2])
    queued = dataclasses.replace(spec, req_id="queued", chunks=spec.chunks[2:])
    k0, k1 = first.chunks[0].object_key, second.chunks[0].object_key
    gates, entered, reads = gate_keys(kvc, [k0, k1])
    ws.start_load_kv(meta(first, second, queued))  # type: ignore[arg-type]
    assert entered[k0].wait(30)  # the first is pulling on the one load thread
    clock.t += 0.8
    gates[k0].set()  # the first ends in time
    assert entered[k1].wait(30)  # the second started (at 0.8 s: its deadline 1.8 s)
    assert finish(ws, "first") == set()
    clock.t += 0.4  # 1.2 s: past the queued one's deadline, not the second's
    _, done = ws.get_finished(set())
    assert done == {"queued"}
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in queued.chunks for b in ch.block_ids if b >= 0
    }
    stats = ws.take_stats()
    assert stats["load_queue_timeouts"] == 1 and "load_timeouts" not in stats
    assert not ws.store_breaker.is_open
    worker_meta = ws.build_worker_meta()
    assert worker_meta is None or not worker_meta.bad_objects
    gates[k1].set()
    assert finish(ws, "second") == set()
    for cache in ws.caches.values():  # the given-up restore wrote nothing
        for ch in queued.chunks:
            assert not cache[[b for b in ch.block_ids if b >= 0]].any()
    # its objects are still offered, and restored; the one load thread runs in order, so
    # the given-up restore had its turn first: it never reached the store (one read each,
    # this restore's)
    again = dataclasses.replace(queued, req_id="again")
    assert step(ws, again) == set()
    assert_blocks_hold(ws, kv, again, range(2))
    assert all(reads.get(ch.object_key) == 1 for ch in queued.chunks)


def test_a_restore_given_up_reports_what_the_store_delivered(tmp_path: Path) -> None:
    """The cost guard's measure of a store too slow to finish a restore: the bytes of the
    layers that came in before the timeout, over the time it had."""
    ws, kvc, _, spec = setup(tmp_path, load_timeout=1.0)
    clock = _Clock()
    ws._clock = clock
    late = [ch.object_key for ch in spec.chunks[2:]]
    gates, _, _ = gate_keys(kvc, late)  # chunks 0 and 1 come, 2 and 3 hang
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    load = ws._loads[spec.req_id]
    deadline = time.monotonic() + 30
    while sum(load.written) < 2 * ws.num_layers:  # both layers of two chunks written
        assert time.monotonic() < deadline
        time.sleep(0.005)
    clock.t += 1.5
    _, done = ws.get_finished(set())
    assert done == {spec.req_id}
    for gate in gates.values():
        gate.set()
    meta = ws.build_worker_meta()
    assert meta is not None
    # half the restore's bytes (every chunk the same size), in the 1.5 s it had
    assert meta.given_up_bytes == sum(ch.size for ch in spec.chunks) // 2
    assert meta.given_up_s == pytest.approx(1.5)
    ws._pool.shutdown(wait=True)


def test_with_a_drafter_the_save_waits_for_its_kv(tmp_path: Path) -> None:
    """V1 defers ``wait_for_save`` past the drafter so that its KV layers are written before
    the chunk is copied (``gpu_model_runner``: "to allow draft model to also save its KV
    cache"); ``get_finished`` comes before the drafter. With a drafter the copy must wait
    for ``wait_for_save``: what a layer holds after ``get_finished`` is what is stored."""
    from kvcloud.integrations.vllm.specs import SaveChunk, SaveSpec

    ws, kvc, kv, fps = saver(tmp_path)
    ws.drafter = True
    ns = ws.ns
    last = f"model.layers.{ns.num_layers - 1}.self_attn.attn"  # the drafter's, here
    layout = ws.layouts[last]
    ws.start_load_kv(
        meta(saves=[SaveSpec("r1", "default", [SaveChunk(0, fps[0], ns.digest, SAVE_IDS[0])])])
    )  # type: ignore[arg-type]
    ws.get_finished(set())
    ws.get_block_ids_with_load_errors()
    # the drafter runs now, writing its layer's KV for the chunk's tokens
    drafted = torch.from_numpy(kv[ns.num_layers - 1, :, : ns.chunk_tokens]) + 1.0
    layout.scatter(ws.caches[last], SAVE_IDS[0], drafted)
    ws.wait_for_save()
    assert ws.uploader is not None
    ws.uploader.close()
    m = kvc.lookup(ns, [int(t) for t in make_tokens(ns.chunk_tokens)])
    assert m.tokens == ns.chunk_tokens
    got = kvc.pull(m)
    assert same_bits(got[: ns.num_layers - 1], kv[: ns.num_layers - 1, :, : ns.chunk_tokens])
    assert same_bits(got[ns.num_layers - 1], drafted.numpy())  # the drafter's, not the old
    ws.shutdown()
