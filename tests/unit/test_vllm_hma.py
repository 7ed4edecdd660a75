"""Several KV cache groups (vLLM's hybrid allocator, ``SupportsHMA``) without vLLM: a model
whose even layers slide (group 0) and odd layers attend to everything (group 1), each group
with block ids of its own.

Checked against what vLLM 0.32 does (``v1/core/single_type_kv_cache_manager.py``,
``v1/core/sched/scheduler.py``):
- a sliding group's blocks behind the window are vLLM's null block in the ids it hands
  over, and blocks that fall behind it later are freed at the next schedule while this
  side's list still names them: a chunk is saved only while every group holds all of it;
- each layer is saved from, and restored into, its own group's blocks (a sliding group's
  only inside its window);
- a failed restore is reported as the request failed (vLLM raises on block ids with
  several groups), and no restore runs in the step (nothing could report it failed).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcloud import KVCloud  # noqa: E402
from kvcloud.errors import ConfigError  # noqa: E402
from kvcloud.integrations.vllm.config import VLLMConnectorConfig  # noqa: E402
from kvcloud.integrations.vllm.keys import group_windows  # noqa: E402
from kvcloud.integrations.vllm.layout import learn_layout  # noqa: E402
from kvcloud.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvcloud.integrations.vllm.specs import (  # noqa: E402
    NULL_BLOCK,
    LoadChunk,
    LoadSpec,
    SaveChunk,
    SaveSpec,
    whole_failures,
)
from kvcloud.integrations.vllm.worker import WorkerSide, sharing_group  # noqa: E402
from tests.helpers import make_kv, make_ns, make_tokens, same_bits  # noqa: E402
from tests.unit.test_vllm_layout import cpu_write, layer_for  # noqa: E402
from tests.unit.test_vllm_scheduler import ask, output, request, stored  # noqa: E402,F401

BS = 8  # two blocks per 16-token chunk
C = 16
N_BLOCKS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class Groups:
    """vLLM's KVCacheBlocks: one list of block ids per group."""

    def __init__(self, *ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def two_group_side(kvc: KVCloud, window: int | None, **cfg: object) -> SchedulerSide:
    config = VLLMConnectorConfig(chunk_tokens=C, **cfg)  # type: ignore[arg-type]
    return SchedulerSide(config, make_ns("float32"), kvc, BS, windows=[window, None])


def saved(meta: object) -> list[tuple[int, list[list[int]]]]:
    return [(ch.position, ch.groups) for spec in meta.saves for ch in spec.chunks]  # type: ignore[attr-defined]


# -- scheduler side --------------------------------------------------------------------------


def test_a_restore_names_every_groups_blocks_and_runs_beside_the_pass(
    stored: tuple[KVCloud, list[int]],  # noqa: F811
) -> None:
    """The hit's chunks carry each group's ids: the sliding group's null blocks behind the
    window stay null (nothing written there), a chunk wholly behind it is still pulled for
    the full group; ``load_mode=sync`` still restores beside the pass."""
    kvc, tokens = stored
    s = two_group_side(kvc, window=3 * BS, load_mode="sync")
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C  # is_async: beside the pass, although load_mode=sync
    # vLLM: 64 computed tokens, window 24: (64 - 24 + 1) // 8 = 5 blocks skipped (null)
    sliding = [NULL_BLOCK] * 5 + [30, 31, 32, 33]
    full = list(range(20, 29))
    s.update_state_after_alloc(req, Groups(sliding, full), 4 * C)
    meta = s.build_connector_meta(output())
    (spec,) = meta.loads
    assert not spec.sync
    assert [ch.groups for ch in spec.chunks] == [
        [sliding[i : i + 2], full[i : i + 2]] for i in (0, 2, 4, 6)
    ]
    assert [ch.block_ids for ch in spec.chunks] == [sliding[i : i + 2] for i in (0, 2, 4, 6)]


def _steps(s: SchedulerSide, tokens: list[int]) -> list[tuple[int, list[list[int]]]]:
    """A request computed 24 tokens, then 7, then 1 (a chunk ending in a one-token step,
    as while decoding): what each step names for saving."""
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 0  # nothing stored under this prompt
    sliding, full = [1, 2, 3, 4], [5, 6, 7, 8]
    new = SimpleNamespace(req_id="r1", block_ids=(sliding, full), num_computed_tokens=0)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": 24}
    names = saved(s.build_connector_meta(out))
    cached = output(cached=[("r1", None, 24, 7)])
    cached.scheduled_cached_reqs.new_block_ids = [None]
    names += saved(s.build_connector_meta(cached))
    cached = output(cached=[("r1", None, 31, 1)])
    cached.scheduled_cached_reqs.new_block_ids = [None]
    return names + saved(s.build_connector_meta(cached))


def test_a_chunk_partly_behind_the_window_when_its_step_runs_is_not_saved(
    tmp_path: Path,
) -> None:
    """Window 8 tokens: when the step computing token 31 was scheduled, vLLM freed the
    sliding group's blocks wholly behind token 31's window ((31 - 8 + 1) // 8 = 3 blocks),
    so chunk 1's first block may hold another request's KV by the time it is copied: it is
    not saved (counted). With no sliding group the same steps save it."""
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    tokens = [int(t) for t in make_tokens(2 * C + 5)]
    s = two_group_side(kvc, window=BS)
    assert _steps(s, tokens) == [(0, [[1, 2], [5, 6]])]
    assert s.take_stats()["saves_skipped"] == 1
    whole = SchedulerSide(
        VLLMConnectorConfig(chunk_tokens=C), make_ns("float32"), kvc, BS, windows=[None, None]
    )
    assert _steps(whole, tokens) == [(0, [[1, 2], [5, 6]]), (1, [[3, 4], [7, 8]])]
    # a window that still covers the chunk's first block saves it (24 tokens: none freed)
    wide = two_group_side(kvc, window=3 * BS)
    assert [p for p, _ in _steps(wide, tokens)] == [0, 1]
    kvc.close()


def test_a_chunk_with_a_null_block_in_any_group_is_not_saved(tmp_path: Path) -> None:
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    tokens = [int(t) for t in make_tokens(2 * C + 5)]
    s = two_group_side(kvc, window=BS)
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 0
    blocks = ([NULL_BLOCK, 2, 3, 4], [5, 6, 7, 8])
    new = SimpleNamespace(req_id="r1", block_ids=blocks, num_computed_tokens=0)
    out = output(new=[new])
    out.num_scheduled_tokens = {"r1": 2 * C}
    assert saved(s.build_connector_meta(out)) == [(1, [[3, 4], [7, 8]])]
    kvc.close()


# -- worker side -----------------------------------------------------------------------------

# per chunk: the sliding group's ids (layer 0) and the full group's (layer 1), disjoint as
# vLLM's shared block pool makes them
SLIDE = [[1, 2], [3, 4]]
FULL = [[9, 5], [11, 12]]


def worker(tmp_path: Path, **cfg: object) -> tuple[WorkerSide, KVCloud]:
    ns = make_ns("float32")  # 2 layers, 2 heads × 8, 16-token chunks
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    config = VLLMConnectorConfig(**cfg)  # type: ignore[arg-type]
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    specs = (_spec("SlidingWindowSpec", sliding_window=2 * BS), _spec("FullAttentionSpec"))
    kcc = SimpleNamespace(
        num_blocks=N_BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(layer_names=[name], kv_cache_spec=spec)
            for name, spec in zip(LAYERS, specs, strict=True)
        ],
    )
    ws = WorkerSide(config, ns, kvc, vllm_config, kcc)
    write = layer_for(cpu_write)
    for layer, name in enumerate(LAYERS):
        cache = torch.zeros(N_BLOCKS, ns.num_kv_heads, BS, 2 * ns.head_dim)
        ws.caches[name], ws.layer_index[name] = cache, layer
        ws.layouts[name] = learn_layout(write, cache, N_BLOCKS, BS, ns.num_kv_heads, ns.head_dim)
    assert ws.groups == 2 and ws.group_of == {LAYERS[0]: 0, LAYERS[1]: 1}
    assert ws.whole_failures
    return ws, kvc


def test_each_layer_is_saved_from_its_own_groups_blocks(tmp_path: Path) -> None:
    """Layer 0's KV is in the sliding group's blocks, layer 1's in the full group's (the
    other group's blocks hold garbage in each layer): the stored chunks read back bit for
    bit with a plain pull."""
    ws, kvc = worker(tmp_path, write_policy="write-through")
    ns = ws.ns
    tokens = [int(t) for t in make_tokens(2 * C)]
    kv = make_kv(ns, len(tokens))
    for layer, name in enumerate(LAYERS):
        cache = ws.caches[name]
        cache.normal_()  # every block garbage, then this layer's group's blocks its KV
        own = SLIDE if layer == 0 else FULL
        for i, ids in enumerate(own):
            chunk = torch.from_numpy(kv[layer, :, i * C : (i + 1) * C])
            ws.layouts[name].scatter(cache, ids, chunk)
    fps = kvc.fingerprints(ns, tokens)
    chunks = [
        SaveChunk(i, fps[i], fps[i - 1] if i else ns.digest, SLIDE[i], [SLIDE[i], FULL[i]])
        for i in range(2)
    ]
    ws.start_load_kv(SimpleNamespace(loads=[], saves=[SaveSpec("r1", "default", chunks)]))  # type: ignore[arg-type]
    ws.wait_for_save()
    assert ws.uploader is not None
    ws.uploader.close()
    m = kvc.lookup(ns, tokens)
    assert m.tokens == 2 * C
    assert same_bits(kvc.pull(m), kv)
    ws.shutdown()


def _stored_spec(kvc: KVCloud, ns: object, slide: list[list[int]], full: list[list[int]]):  # type: ignore[no-untyped-def]
    tokens = [int(t) for t in make_tokens(2 * C)]
    kv = make_kv(ns, len(tokens))  # type: ignore[arg-type]
    kvc.push(ns, tokens, kv)  # type: ignore[arg-type]
    m = kvc.lookup(ns, tokens)  # type: ignore[arg-type]
    chunks = [
        LoadChunk(ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, s, [s, f])
        for ref, s, f in zip(m.chunks, slide, full, strict=True)
    ]
    return kv, LoadSpec("req-1", "default", chunks)


def _report(ws: WorkerSide, req_id: str) -> tuple[set[int], set[str]]:
    """Poll as vLLM does until the restore is reported: failed blocks, failed requests."""
    deadline = time.monotonic() + 30
    blocks: set[int] = set()
    while True:
        _, done = ws.get_finished(set())
        blocks |= ws.get_block_ids_with_load_errors()
        failed = ws.take_failed_requests()
        if done and req_id in done:
            return blocks, failed
        assert not failed
        assert time.monotonic() < deadline, "the restore was never reported"
        time.sleep(0.002)


def test_each_layer_is_restored_into_its_own_groups_blocks(tmp_path: Path) -> None:
    """The sliding group's first chunk is behind the window (null blocks): layer 0 gets only
    chunk 1's blocks, layer 1 both chunks'; no layer writes the other group's blocks."""
    ws, kvc = worker(tmp_path, write_policy="off")
    slide = [[NULL_BLOCK, NULL_BLOCK], SLIDE[1]]
    kv, spec = _stored_spec(kvc, ws.ns, slide, FULL)
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    assert _report(ws, spec.req_id) == (set(), set())
    for layer, name in enumerate(LAYERS):
        cache, layout = ws.caches[name], ws.layouts[name]
        own = slide if layer == 0 else FULL
        written = set()
        for i, ids in enumerate(own):
            for k, b in enumerate(ids):
                if b == NULL_BLOCK:
                    continue
                want = np.ascontiguousarray(kv[layer, :, i * C + k * BS : i * C + (k + 1) * BS])
                assert same_bits(layout.gather(cache, [b]).numpy(), want), (name, i, b)
                written.add(b)
        for b in range(N_BLOCKS):  # the null block and the other group's: untouched
            if b not in written:
                assert not layout.gather(cache, [b]).numpy().any(), (name, b)
    assert ws.take_stats()["loaded_tokens"] == 2 * C  # the full group's every token
    ws.shutdown()


def test_a_failed_restore_is_reported_as_its_request_not_as_blocks(tmp_path: Path) -> None:
    """vLLM 0.32 raises on block ids reported failed when there are several groups (they
    name no group): the request is reported failed (``failed_recving``), counted, and vLLM
    recomputes it whole."""
    ws, kvc = worker(tmp_path, write_policy="off")
    _, spec = _stored_spec(kvc, ws.ns, SLIDE, FULL)
    key = spec.chunks[1].object_key
    data = bytearray(kvc.store.get(key))
    data[-100] ^= 0x01
    kvc.store.delete(key)
    kvc.store.put(key, bytes(data))
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    assert _report(ws, spec.req_id) == (set(), {"req-1"})
    stats = ws.take_stats()
    assert stats["restores_failed_whole"] == 1 and stats.get("loaded_tokens", 0) == 0
    ws.shutdown()


# -- start ----------------------------------------------------------------------------------


def _spec(kind: str, **fields: object) -> object:
    return type(kind, (), {"block_size": BS, **fields})()


def _groups(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_group_windows_names_each_groups_window_and_refuses_the_rest() -> None:
    full, slide = _spec("FullAttentionSpec"), _spec("SlidingWindowSpec", sliding_window=512)
    assert group_windows(_groups(slide, full)) == [512, None]
    # the hybrid allocator off: vLLM's FullAttentionSpec keeps the window, and every block
    assert group_windows(_groups(_spec("FullAttentionSpec", sliding_window=512))) == [None]
    for kind in ("ChunkedLocalAttentionSpec", "CrossAttentionSpec", "RSWASpec"):
        with pytest.raises(ConfigError, match=kind):
            group_windows(_groups(_spec(kind, sliding_window=64), full))
        with pytest.raises(ConfigError, match=kind):
            group_windows(_groups(_spec(kind, sliding_window=64)))
    with pytest.raises(ConfigError, match="block sizes"):
        group_windows(_groups(slide, _spec("FullAttentionSpec", block_size=2 * BS)))


def test_a_layer_sharing_another_layers_kv_joins_its_group() -> None:
    group_of = {LAYERS[0]: 0, LAYERS[1]: 1}
    sharing = SimpleNamespace(kv_sharing_target_layer_name=LAYERS[1])
    assert sharing_group("model.layers.2.self_attn.attn", sharing, group_of) == 1
    with pytest.raises(ConfigError, match="no KV cache group"):
        sharing_group("model.layers.2.self_attn.attn", SimpleNamespace(), group_of)


def test_with_one_sliding_group_failures_are_whole_and_restores_beside_the_pass(
    stored: tuple[KVCloud, list[int]],  # noqa: F811
) -> None:
    """One group, all of it sliding: vLLM already put its null block behind the restore
    point's window, which a recompute from a failed block inside the restore would attend
    over; so a failure recomputes the request whole, and no restore runs in the step."""
    assert whole_failures([256]) and whole_failures([None, None])
    assert not whole_failures([None]) and not whole_failures([])
    kvc, tokens = stored
    s = SchedulerSide(
        VLLMConnectorConfig(chunk_tokens=C, load_mode="sync"),
        make_ns("float32"), kvc, BS, windows=[3 * BS],
    )  # fmt: skip
    req = request("r1", tokens)
    s.on_new_request(req)
    assert ask(s, req) == 4 * C  # asynchronous although load_mode=sync
