"""Tensor parallelism without vLLM: two worker sides playing the ranks of a TP-2 vLLM, each
holding half the KV heads in a cache laid out like vLLM's CPU backend, save a chunk as two
parts; the rank whose part is stored last registers it; a whole-model reader (a TP-1 vLLM,
kvcloud's own pull) and each rank of another TP-2 vLLM restore it bit for bit. And the
reverse: a chunk a TP-1 vLLM stored whole restores into each TP-2 rank's heads. The same
for pipeline parallelism: four worker sides playing a PP-2 × TP-2 vLLM (each stage holding
half the layers) save a chunk as a grid of four parts, restored by whole-model readers and
by each rank of the grid.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcloud import KVCloud  # noqa: E402
from kvcloud.integrations.vllm.config import VLLMConnectorConfig  # noqa: E402
from kvcloud.integrations.vllm.layout import learn_layout  # noqa: E402
from kvcloud.integrations.vllm.shard import Shard, shard_of  # noqa: E402
from kvcloud.integrations.vllm.specs import (  # noqa: E402
    LoadChunk,
    LoadSpec,
    SaveChunk,
    SaveSpec,
)
from kvcloud.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.helpers import make_kv, make_ns, make_tokens, same_bits  # noqa: E402
from tests.unit.test_vllm_layout import cpu_write, layer_for  # noqa: E402
from tests.unit.test_vllm_worker_loads import finish  # noqa: E402

BS = 8
N_BLOCKS = 6
H = 4  # the model's KV heads


@pytest.mark.parametrize(
    ("rank", "tp", "heads", "want"),
    [
        (0, 1, 4, Shard(0, 4, 1, True)),
        (1, 2, 4, Shard(2, 4, 2, True)),
        (3, 4, 4, Shard(3, 4, 4, True)),
        # more ranks than KV heads: each head on tp // heads consecutive ranks, the first
        # of them writes (vLLM's QKVParallelLinear: rank r holds head r // replicas)
        (2, 4, 2, Shard(1, 2, 2, True)),
        (3, 4, 2, Shard(1, 2, 2, False)),
        (5, 8, 1, Shard(0, 1, 1, False)),
    ],
)
def test_shard_of(rank: int, tp: int, heads: int, want: Shard) -> None:
    assert shard_of(rank, tp, heads) == want


def test_shard_of_refuses_what_vllm_cannot_split() -> None:
    with pytest.raises(ValueError):
        shard_of(0, 3, 4)
    with pytest.raises(ValueError):
        shard_of(2, 2, 4)


L = 4  # the model's layers (two pipeline stages of two)


def rank(tmp_path: Path, shard: Shard, **cfg: object) -> tuple[WorkerSide, KVCloud]:
    ns = make_ns("float32", num_kv_heads=H, num_layers=L)
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    config = VLLMConnectorConfig(**cfg)  # type: ignore[arg-type]
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    ws = WorkerSide(config, ns, kvc, vllm_config, SimpleNamespace(num_blocks=N_BLOCKS), shard=shard)
    first = shard.layers[0] if shard.layers else 0
    for layer in range(ws.num_layers):  # a stage's caches are its own layers, counted from 0
        name = f"model.layers.{first + layer}.self_attn.attn"
        cache = torch.zeros(N_BLOCKS, shard.num_heads, BS, 2 * ns.head_dim)
        ws.caches[name], ws.layer_index[name] = cache, layer
        ws.layouts[name] = learn_layout(
            layer_for(cpu_write), cache, N_BLOCKS, BS, shard.num_heads, ns.head_dim
        )
    return ws, kvc


def fill(ws: WorkerSide, kv: np.ndarray, blocks: list[int]) -> None:
    """What vLLM's forward pass leaves in a rank's blocks: its heads (and layers) of ``kv``."""
    lo, hi = ws.shard.lo, ws.shard.hi
    first = ws.shard.layers[0] if ws.shard.layers else 0
    for name, layer in ws.layer_index.items():
        part = torch.from_numpy(np.ascontiguousarray(kv[first + layer, :, :, lo:hi]))
        ws.layouts[name].scatter(ws.caches[name], blocks, part)


def restores_its_heads(
    where: Path,
    r: int,
    client: KVCloud,
    m: Any,
    kv: np.ndarray,
    blocks: list[list[int]],
    shard: Shard | None = None,
) -> int:
    """Rank ``r`` of a TP-2 vLLM (or the rank ``shard``) restores the match ``m`` into
    ``blocks``: its caches then hold exactly its heads (and layers) of ``kv``. Returns the
    bytes it downloaded."""
    ws, _ = rank(where, shard or shard_of(r, 2, H), write_policy="off")
    ws.client = client
    chunks = [
        LoadChunk(ref.position, ref.fp, ref.parent, ref.entry.object_key, ref.entry.size, ids)
        for ref, ids in zip(m.chunks, blocks, strict=True)
    ]
    load = LoadSpec(f"load{r}", "default", chunks)
    ws.start_load_kv(SimpleNamespace(loads=[load], saves=[]))  # type: ignore[arg-type]
    assert finish(ws, load.req_id) == set()
    lo, hi = ws.shard.lo, ws.shard.hi
    first = ws.shard.layers[0] if ws.shard.layers else 0
    for name, layer in ws.layer_index.items():
        got = ws.layouts[name].gather(ws.caches[name], [b for ids in blocks for b in ids])
        assert same_bits(got.numpy(), np.ascontiguousarray(kv[first + layer, :, :, lo:hi]))
    loaded = int(ws.take_stats().get("loaded_bytes", 0))
    ws.shutdown()
    return loaded


def save_from(
    ranks: list, reader: KVCloud, ns: Any, tokens: Any, kv: np.ndarray, parts_each: int = 1
) -> int:
    """Each rank in turn saves the two chunks of ``tokens`` (its heads and layers of ``kv``,
    as vLLM's forward pass left them in its blocks) and its uploader drains; the chunks are a
    miss until the last rank's parts are in. Returns the chunks the ranks registered."""
    fps = reader.fingerprints(ns, tokens)
    parents = [ns.digest, *fps[:-1]]
    blocks = [[1, 2], [3, 4]]  # block 0 is vLLM's null block
    spec = SaveSpec(
        "req", "default", [SaveChunk(i, fps[i], parents[i], blocks[i]) for i in range(2)]
    )
    meta = SimpleNamespace(loads=[], saves=[spec])
    registered = 0
    for n, (ws, _) in enumerate(ranks):
        fill(ws, kv, [b for bl in blocks for b in bl])
        ws.start_load_kv(meta)  # type: ignore[arg-type]  # (notes the step's saves)
        ws.wait_for_save()  # copies them, after the pass
        assert ws.uploader is not None
        ws.uploader.close()  # waits for the queue to drain
        stats = ws.take_stats()
        assert stats["parts_pushed"] == 2 * parts_each
        registered += stats.get("chunks_registered", 0)
        # some ranks' parts alone register nothing: a miss until every part is in
        assert reader.lookup(ns, tokens).tokens == (0 if n < len(ranks) - 1 else len(tokens))
    return registered


def test_a_tp2_save_restores_into_tp1_and_tp2(tmp_path: Path) -> None:
    ns = make_ns("float32", num_kv_heads=H, num_layers=L)
    tokens = make_tokens(2 * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    ranks = [rank(tmp_path, shard_of(r, 2, H)) for r in range(2)]
    reader = KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s"
    )
    assert save_from(ranks, reader, ns, tokens, kv) == 2  # each chunk once, by the last rank
    m = reader.lookup(ns, tokens)
    assert all(len(ref.entry.keys) == 2 for ref in m.chunks)
    # a TP-1 reader gets the whole KV, bit for bit
    assert same_bits(reader.pull(m), kv)
    # each rank of another TP-2 vLLM restores its own heads
    for r in range(2):
        restores_its_heads(tmp_path / f"reader{r}", r, reader, m, kv, [[5, 4], [1, 2]])
    for ws, _ in ranks:
        ws.shutdown()
    reader.close()


def test_replicas_do_not_write(tmp_path: Path) -> None:
    # TP 4 over 2 KV heads: ranks 1 and 3 hold copies, only ranks 0 and 2 write
    assert rank(tmp_path, shard_of(1, 4, 2))[0].uploader is None
    assert rank(tmp_path / "w", shard_of(2, 4, 2))[0].uploader is not None


def test_a_tp1_chunk_restores_into_each_tp2_rank(tmp_path: Path) -> None:
    ns = make_ns("float32", num_kv_heads=H, num_layers=L)
    kvc = KVCloud.open(store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s")
    tokens = make_tokens(2 * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    kvc.push(ns, tokens, kv)  # what a TP-1 vLLM stores: whole chunks
    m = kvc.lookup(ns, tokens)
    for r in range(2):
        restores_its_heads(tmp_path / f"r{r}", r, kvc, m, kv, [[1, 2], [3, 4]])
    # and each stage of a PP-2 vLLM (at TP 1 and TP 2) restores its layers of them
    for stage in range(2):
        for tp in (1, 2):
            for r in range(tp):
                shard = shard_of(r, tp, H).with_stage(stage, STAGES)
                where = tmp_path / f"pp{stage}-{tp}-{r}"
                restores_its_heads(where, r, kvc, m, kv, [[1, 2], [3, 4]], shard)
    kvc.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_head_parts_store_finer_so_a_larger_tp_reads_only_its_heads(
    tmp_path: Path, tp: int
) -> None:
    """``head_parts`` 4 on a TP-1 or TP-2 vLLM: each chunk is stored as 4 head ranges (a
    TP-2 rank writes two), and a rank of a TP-4 vLLM downloads only its quarter, where a
    chunk stored whole costs it the whole object (defect 9). A TP-1 reader still gets every
    head, bit for bit."""
    ns = make_ns("float32", num_kv_heads=H, num_layers=L)
    tokens = make_tokens(2 * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    ranks = [rank(tmp_path, shard_of(r, tp, H).with_head_parts(4, H)) for r in range(tp)]
    reader = KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s"
    )
    assert save_from(ranks, reader, ns, tokens, kv, parts_each=4 // tp) == 2
    m = reader.lookup(ns, tokens)
    assert [len(ref.entry.keys) for ref in m.chunks] == [4, 4]
    assert same_bits(reader.pull(m), kv)
    for r in range(4):
        got = restores_its_heads(
            tmp_path / f"tp4-{r}", r, reader, m, kv, [[1, 2], [3, 4]], shard_of(r, 4, H)
        )
        # exactly the objects of its own head range, one a chunk
        mine = [reader.store.head(ref.entry.keys[r]) for ref in m.chunks]
        assert got == sum(info.size for info in mine if info is not None)
    for ws, _ in ranks:
        ws.shutdown()
    # the same chunks stored whole (the default at TP 1): each TP-4 rank pays for every head
    other = tmp_path / "whole"
    kvc = KVCloud.open(store=f"file://{other}/o", index=f"sqlite://{other}/i.db", secret="s")
    kvc.push(ns, tokens, kv)
    m = kvc.lookup(ns, tokens)
    got = restores_its_heads(other / "r0", 0, kvc, m, kv, [[1, 2], [3, 4]], shard_of(0, 4, H))
    assert got == sum(ref.entry.size for ref in m.chunks)
    kvc.close()
    reader.close()


def test_head_parts_must_split_the_heads_within_the_ranks() -> None:
    assert shard_of(1, 2, H).with_head_parts(4, H).write_ranges() == [(2, 3), (3, 4)]
    assert shard_of(0, 1, H).with_head_parts(2, H).write_ranges() == [(0, 2), (2, 4)]
    assert shard_of(0, 1, H).with_head_parts(1, H).write_ranges() == [None]
    # fewer than the TP split: the TP split
    assert shard_of(1, 4, H).with_head_parts(2, H).write_ranges() == [(1, 2)]
    for bad in (3, 8):
        with pytest.raises(ValueError, match="head_parts"):
            shard_of(0, 1, H).with_head_parts(bad, H)


STAGES = (0, 2, L)


def test_shard_with_stage() -> None:
    s = shard_of(1, 2, H).with_stage(1, STAGES)
    assert (s.lo, s.hi, s.layers, s.stages, s.split) == (2, 4, (2, 4), STAGES, True)
    assert s.num_layers(L) == 2
    assert shard_of(0, 1, H).with_stage(0, (0, L)) == shard_of(0, 1, H)  # one stage: unchanged
    assert not shard_of(0, 1, H).split and shard_of(0, 1, H).with_stage(0, STAGES).split
    with pytest.raises(ValueError):
        shard_of(0, 1, H).with_stage(2, STAGES)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pp2_save_is_a_grid_restored_by_every_shape(tmp_path: Path, tp: int) -> None:
    """The ranks of a PP-2 × TP-``tp`` vLLM save a chunk, each its layers and heads; the
    rank whose part is stored last registers the grid. A whole-model reader, each rank of a
    PP-2 × TP-2 vLLM and each TP-2 rank without PP restore it bit for bit."""
    ns = make_ns("float32", num_kv_heads=H, num_layers=L)
    tokens = make_tokens(2 * ns.chunk_tokens)
    kv = make_kv(ns, len(tokens))
    shards = [shard_of(r, tp, H).with_stage(st, STAGES) for st in range(2) for r in range(tp)]
    ranks = [rank(tmp_path, sh) for sh in shards]
    reader = KVCloud.open(
        store=f"file://{tmp_path}/o", index=f"sqlite://{tmp_path}/i.db", secret="s"
    )
    assert save_from(ranks, reader, ns, tokens, kv) == 2
    m = reader.lookup(ns, tokens)
    assert all([s[0] for s in ref.entry.stages] == [(0, 2), (2, 4)] for ref in m.chunks)
    assert all(len(ref.entry.keys) == 2 * tp for ref in m.chunks)
    assert same_bits(reader.pull(m), kv)
    restore_at = [[5, 4], [1, 2]]
    for st in range(2):
        for r in range(2):
            shard = shard_of(r, 2, H).with_stage(st, STAGES)
            restores_its_heads(tmp_path / f"pp{st}-{r}", r, reader, m, kv, restore_at, shard)
    for r in range(2):
        restores_its_heads(tmp_path / f"tp{r}", r, reader, m, kv, restore_at)
    for ws, _ in ranks:
        ws.shutdown()
    reader.close()
