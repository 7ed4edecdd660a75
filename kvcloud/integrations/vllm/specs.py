"""What the worker side must load and save in one step (carried by the connector metadata).

Plain data without vLLM types, so the worker side can be exercised without a vLLM install.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's block pool hands out block 0 as its shared null block (v1/core/block_pool.py): what
# a sliding-window request holds for blocks out of its window. Never loaded into, never saved.
NULL_BLOCK = 0


@dataclass
class LoadChunk:
    position: int  # chunk index in the prompt
    fp: bytes
    parent: bytes
    object_key: str
    size: int
    # vLLM block id for each block-sized slice of the chunk; -1 for a slice vLLM already
    # holds (its own prefix-cache hit), which is left alone
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    tenant: str
    chunks: list[LoadChunk]
    # restored inside the step that schedules it (vLLM was told load_async=False): the
    # forward pass waits for it
    sync: bool = False
    # nothing to pull: the blocks are reported failed at once (the scheduler side could not
    # plan this load, but vLLM already expects the blocks filled)
    refused: bool = False


@dataclass
class SaveChunk:
    position: int
    fp: bytes
    parent: bytes
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    tenant: str
    chunks: list[SaveChunk]


@dataclass
class StepSpec:
    """One step's loads and saves (the connector metadata carries exactly these)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # tokens the step computes (vLLM's total_num_scheduled_tokens): with the pass's time,
    # the prefill rate the cost guard compares restores with
    tokens: int = 0


@dataclass
class KVCloudWorkerMeta:
    """What the workers tell the scheduler side after a step (vLLM's worker → scheduler
    channel, ``KVConnectorWorkerMetadata``: vLLM only calls ``aggregate`` on it): objects
    whose pull failed or timed out (not to be offered for that many seconds), and the store's
    breaker (seconds until its next probe while open; ``store_ok`` once it closed again);
    and the bytes and seconds of the restores that ended, in the step and beside it, from
    which ``load_mode=auto`` predicts how long the next one would stall a step; the tokens
    and seconds of the forward passes timed (the prefill rate), and the bytes and seconds
    of restores given up at their timeout (what the store delivered in the time they had).
    Both feed the cost guard (cost.py)."""

    bad_objects: dict[str, float] = field(default_factory=dict)
    store_retry_in: float = 0.0
    store_ok: bool = False
    in_step_bytes: int = 0
    in_step_s: float = 0.0
    beside_bytes: int = 0
    beside_s: float = 0.0
    pass_tokens: int = 0
    pass_s: float = 0.0
    given_up_bytes: int = 0
    given_up_s: float = 0.0

    def aggregate(self, other: KVCloudWorkerMeta) -> KVCloudWorkerMeta:
        if isinstance(other, KVCloudWorkerMeta):
            self.bad_objects.update(other.bad_objects)
            self.store_retry_in = max(self.store_retry_in, other.store_retry_in)
            self.store_ok = self.store_ok and other.store_ok
            self.in_step_bytes += other.in_step_bytes
            self.in_step_s += other.in_step_s
            self.beside_bytes += other.beside_bytes
            self.beside_s += other.beside_s
            self.pass_tokens += other.pass_tokens
            self.pass_s += other.pass_s
            self.given_up_bytes += other.given_up_bytes
            self.given_up_s += other.given_up_s
        return self
