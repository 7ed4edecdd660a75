"""What the worker side must load and save in one step (carried by the connector metadata).

Plain data without vLLM types, so the worker side can be exercised without a vLLM install.
"""

from __future__ import annotations

from dataclasses import dataclass


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
