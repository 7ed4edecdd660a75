"""What the worker side must load and save in one step (carried by the connector metadata).

Plain data without vLLM types, so the worker side can be exercised without a vLLM install.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's block pool hands out block 0 as its shared null block (v1/core/block_pool.py): what
# a sliding-window request holds for blocks out of its window. Never loaded into, never saved.
NULL_BLOCK = 0


def whole_failures(windows: list[int | None]) -> bool:
    """Whether a failed restore must be reported as its whole request failed (recomputed
    from its first token), never as failed blocks (recomputed from the first of them):
    with several KV cache groups vLLM takes no block ids (they name no group), and with a
    sliding window it has already put its null block behind the restore point's window,
    which a recompute from a block inside the restore would attend over. Such restores
    run beside the pass: only a request waiting for its KV can be reported failed whole."""
    return len(windows) > 1 or any(w is not None for w in windows)


def group_ids(chunk: LoadChunk | SaveChunk) -> list[list[int]]:
    """A chunk's block ids per KV cache group (one group: its ``block_ids``)."""
    return chunk.groups or [chunk.block_ids]


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
    # a model with several KV cache groups (vLLM's hybrid allocator): each group's ids, the
    # first being ``block_ids``; empty with one group
    groups: list[list[int]] = field(default_factory=list)


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
    groups: list[list[int]] = field(default_factory=list)  # (as LoadChunk's)


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


def spans(block_ids: list[int]) -> list[tuple[int, int]]:
    """The runs of a chunk's block slots to write: blocks vLLM already holds (-1, a prefix)
    and a sliding window's null blocks are skipped. Usually one span, the whole chunk or its
    tail after vLLM's own prefix hit."""
    out: list[tuple[int, int]] = []
    for k, b in enumerate(block_ids):
        if b < 0 or b == NULL_BLOCK:
            continue
        if out and out[-1][1] == k:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out


def filled(spec: LoadSpec) -> list[list[int]]:
    """Per chunk, the blocks a restore writes: not those vLLM already holds (-1) nor a
    sliding window's null block (with several KV cache groups, every group's)."""
    return [
        [b for ids in group_ids(ch) for b in ids if b >= 0 and b != NULL_BLOCK]
        for ch in spec.chunks
    ]


def restored_tokens(spec: LoadSpec, chunks: slice, block_size: int) -> int:
    """Tokens a restore's ``chunks`` put in place: those of the group with most blocks
    written (a sliding group holds only its window)."""
    return block_size * sum(
        max(sum(1 for b in ids if b >= 0 and b != NULL_BLOCK) for ids in group_ids(ch))
        for ch in spec.chunks[chunks]
    )
