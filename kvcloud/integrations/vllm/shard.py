"""Which KV heads a tensor-parallel rank holds, and who writes them.

vLLM splits a model's KV heads evenly over the TP ranks; with more ranks than KV heads each
head is replicated on ``tp // heads`` consecutive ranks (``QKVParallelLinear``: rank r holds
head ``r // replicas``). kvcloud's namespace is the whole model's at every TP size, and a
chunk saved by a TP > 1 vLLM is stored in parts, one per distinct head range, written by the
first rank of each replica group; the writer whose part is stored last registers the chunk
(``KVCloud.store_part`` / ``offer_part``). Any rank reads the parts that overlap its heads,
or its slice of a chunk stored whole, so vLLMs of any TP size share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    lo: int  # first KV head this rank holds
    hi: int  # one past the last
    parts: int  # distinct head ranges over the TP group: a chunk's parts
    writer: bool  # the first rank of its replica group: it saves its part

    @property
    def heads(self) -> tuple[int, int] | None:
        """The head range this rank pulls and stores; None for every head (TP 1)."""
        return None if self.parts == 1 else (self.lo, self.hi)

    @property
    def num_heads(self) -> int:
        return self.hi - self.lo


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
