"""What the client's calls return: a lookup's match and the accounts of a push and a pull."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..indexes.base import IndexEntry
from ..namespace import Namespace


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One matched chunk: its position, fingerprints and index entry."""

    position: int
    fp: bytes
    parent: bytes
    entry: IndexEntry


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a prompt. ``tokens`` is a multiple of chunk_tokens."""

    ns: Namespace
    tenant: str
    chunks: tuple[ChunkRef, ...]
    prompt_chunks: int  # full chunks in the prompt that was looked up

    @property
    def tokens(self) -> int:
        return len(self.chunks) * self.ns.chunk_tokens

    @property
    def nbytes(self) -> int:
        """Stored size of the matched objects (what a pull transfers)."""
        return sum(c.entry.size for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class PushResult:
    chunks: int = 0  # full chunks in the prefix
    already_indexed: int = 0  # had an entry before this push (nothing written)
    pushed: int = 0  # newly registered entries
    objects_written: int = 0  # new objects (a pushed chunk may reuse an existing object)
    bytes_written: int = 0
    failed: int = 0
    keys: list[str] = field(default_factory=list)  # object key of every chunk, in order


@dataclass
class PullResult:
    array: np.ndarray  # [layers, 2, tokens, kv_heads, head_dim] view of the filled prefix
    tokens: int
    chunks: int
    bytes: int
    failures: list[tuple[int, str]] = field(default_factory=list)  # (chunk position, reason)
