"""The vLLM connector's worker side without vLLM: pulls from a real file store into paged
caches laid out like vLLM's CPU backend, layer by layer, as a forward pass would ask.

Checked: what is written is bit for bit what was pushed, through vLLM's block ids (out of
order, some held by vLLM already); no byte of a chunk that fails verification reaches the
cache (DESIGN §4.3), and it and every chunk after it are reported for recompute in the same
step; a layer the forward pass never asked for fails the restore; the staging memory is
reused.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcloud import KVCloud  # noqa: E402
from kvcloud.integrations.vllm.config import VLLMConnectorConfig  # noqa: E402
from kvcloud.integrations.vllm.layout import learn_layout  # noqa: E402
from kvcloud.integrations.vllm.specs import LoadChunk, LoadSpec  # noqa: E402
from kvcloud.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.helpers import make_kv, make_ns, make_tokens, same_bits  # noqa: E402
from tests.unit.test_vllm_layout import cpu_write, layer_for  # noqa: E402

BS = 8  # vLLM block size: two blocks per 16-token chunk
N_BLOCKS = 12
N_CHUNKS = 4


def setup(tmp_path: Path, **cfg: object) -> tuple[WorkerSide, KVCloud, np.ndarray, LoadSpec]:
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
    block_ids = [[-1, 11], [3, 2], [7, 8], [1, 0]]
    chunks = [
        LoadChunk(ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, ids)
        for ref, ids in zip(m.chunks, block_ids, strict=True)
    ]
    return ws, kvc, kv, LoadSpec("req-1", "default", chunks)


def step(ws: WorkerSide, spec: LoadSpec) -> set[int]:
    """What vLLM does around one forward pass with a synchronous load."""
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    for name in ws.layer_index:
        ws.wait_for_layer_load(name)
    ws.wait_for_save()
    return ws.get_block_ids_with_load_errors()


def assert_blocks_hold(ws: WorkerSide, kv: np.ndarray, spec: LoadSpec, chunks: range) -> None:
    c = ws.ns.chunk_tokens
    for name, layer in ws.layer_index.items():
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
    for cache in ws.caches.values():  # never loaded: the reported blocks were not touched
        assert not cache[sorted(failed)].any()
    stats = ws.take_stats()
    assert stats["load_failed_blocks"] == len(failed) and stats["loaded_tokens"] == BS


def test_a_layer_never_asked_for_fails_the_restore(tmp_path: Path) -> None:
    """If the forward pass skipped a layer's wait, that layer was never written: report it."""
    ws, _, _, spec = setup(tmp_path)
    ws.start_load_kv(SimpleNamespace(loads=[spec], saves=[]))  # type: ignore[arg-type]
    ws.wait_for_layer_load("model.layers.0.self_attn.attn")
    ws.wait_for_save()
    assert ws.get_block_ids_with_load_errors() == {
        b for ch in spec.chunks for b in ch.block_ids if b >= 0
    }


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
