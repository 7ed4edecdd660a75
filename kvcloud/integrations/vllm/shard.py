"""Which KV heads (and layers) a tensor-parallel (and pipeline) rank holds, and who writes them.

vLLM splits a model's KV heads evenly over the TP ranks; with more ranks than KV heads each
head is replicated on ``tp // heads`` consecutive ranks (``QKVParallelLinear``: rank r holds
head ``r // replicas``). kvcloud's namespace is the whole model's at every TP size, and a
chunk saved by a TP > 1 vLLM is stored in parts, one per distinct head range, written by the
first rank of each replica group; the writer whose part is stored last registers the chunk
(``KVCloud.store_part`` / ``offer_part``). Any rank reads the parts that overlap its heads,
or its slice of a chunk stored whole, so vLLMs of any TP size share.

Pipeline parallelism splits the layers into stages (vLLM's ``get_pp_indices``); each stage's
ranks hold only their stage's layers. A chunk saved by a PP > 1 vLLM is a grid of parts, one
per (stage, head range), each naming its layer range in its header; the entry names the
stages' layer ranges (``IndexEntry.of_grid``), so a reader of any PP and TP size pulls the
parts that overlap the layers and heads it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shard:
    lo: int  # first KV head this rank holds
    hi: int  # one past the last
    parts: int  # distinct head ranges over the TP group: a chunk's parts
    writer: bool  # the first rank of its replica group: it saves its part
    # the pipeline stage's layers [lo, hi) and every stage's boundaries; None without PP
    layers: tuple[int, int] | None = None
    stages: tuple[int, ...] | None = None
    # head ranges a chunk is stored in: ``parts`` unless the fleet asks for finer ones
    # (``head_parts``), so that ranks of a larger TP size read only their heads
    stored_parts: int = 0

    @property
    def heads(self) -> tuple[int, int] | None:
        """The head range this rank pulls and stores; None for every head (TP 1)."""
        return None if self.parts == 1 else (self.lo, self.hi)

    @property
    def num_heads(self) -> int:
        return self.hi - self.lo

    @property
    def chunk_parts(self) -> int:
        """Head ranges a chunk is stored in (its parts per pipeline stage)."""
        return max(self.parts, self.stored_parts)

    @property
    def split(self) -> bool:
        """Does this rank save a part (of heads, of layers or both) rather than whole chunks?"""
        return self.chunk_parts > 1 or self.layers is not None

    def write_ranges(self) -> list[tuple[int, int] | None]:
        """The head ranges of the parts this rank writes, in head order: its own heads as one
        part, or split in ``chunk_parts // parts`` when the chunk is stored finer; [None]
        for a chunk's every head in one part."""
        if self.chunk_parts == 1:
            return [None]
        w = self.num_heads * self.parts // self.chunk_parts
        return [(a, a + w) for a in range(self.lo, self.hi, w)]

    def with_head_parts(self, head_parts: int, total_kv_heads: int) -> Shard:
        """This shard storing chunks in ``head_parts`` head ranges (never fewer than the TP
        group's ``parts``); ValueError if they do not split the heads into equal ranges,
        each inside one rank's."""
        n = max(self.parts, int(head_parts))
        if total_kv_heads % n or n % self.parts:
            raise ValueError(
                f"head_parts {head_parts} does not split the model's {total_kv_heads} KV heads "
                f"into equal ranges, each inside one of the {self.parts} tensor-parallel "
                f"ranges (use a divisor of {total_kv_heads} that is a multiple of {self.parts})"
            )
        return replace(self, stored_parts=n)

    def num_layers(self, total: int) -> int:
        return total if self.layers is None else self.layers[1] - self.layers[0]

    def with_stage(self, rank: int, stages: tuple[int, ...]) -> Shard:
        """This shard on pipeline stage ``rank`` of the stages with boundaries ``stages``
        (``(0, 2, 4)``: layers [0, 2) and [2, 4)); unchanged for a single stage."""
        if len(stages) < 2 or not 0 <= rank < len(stages) - 1:
            raise ValueError(f"stage {rank} of boundaries {list(stages)}")
        if len(stages) == 2:
            return self
        return replace(self, layers=(stages[rank], stages[rank + 1]), stages=tuple(stages))


def shard_of(rank: int, tp_size: int, total_kv_heads: int) -> Shard:
    """The shard of TP rank ``rank`` of ``tp_size`` for a model with ``total_kv_heads``."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of a TP group of {tp_size}")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads do not split over {tp_size} ranks")
    n = max(1, total_kv_heads // tp_size)
    replicas = max(1, tp_size // total_kv_heads)
    lo = (rank // replicas) * n
    return Shard(lo, lo + n, min(tp_size, total_kv_heads), rank % replicas == 0)
