"""Session records: the stored form of a conversation (its tokens and the objects holding
its KV). One module owns the format so the client, verify and gc read it the same way."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .errors import CorruptObjectError
from .indexes.base import object_keys_of

SESSION_RECORD_VERSION = 1

# The meta key of a record's revision. It lives in ``meta`` rather than a new field so the
# format stays version 1 both ways: older readers ignore it, and records written before it
# existed still load (their ``revision`` is None).
REVISION_KEY = "rev"


def new_revision() -> str:
    """A fresh revision id for one write of a session record."""
    return secrets.token_hex(12)


@dataclass(frozen=True)
class SessionRecord:
    """A session as stored: its token history and the objects holding its KV."""

    session_id: str
    ns: str
    tokens: np.ndarray  # uint32 token history
    kv_tokens: int  # how many leading tokens have stored KV (the last sampled one has none)
    chunk_keys: tuple[str, ...]  # one per full chunk of the first kv_tokens tokens
    tail_key: str | None  # the partial chunk after them, if kv_tokens is not chunk-aligned
    updated: float
    meta: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def revision(self) -> str | None:
        """Which write of the session this record is: a random id per write (not a counter
        and not a time), so a worker that remembers the revision it last wrote or read can
        tell whether anyone wrote since by comparing for equality; clocks of different
        machines never enter. None for a record written without one."""
        rev = self.meta.get(REVISION_KEY)
        return rev if isinstance(rev, str) else None

    @property
    def object_keys(self) -> list[str]:
        """Every object this record needs (gc must keep them): a chunk stored in parts (its
        key joins the parts' keys, as the index entry it was taken from) needs each part."""
        keys = [k for chunk in self.chunk_keys for k in object_keys_of(chunk)]
        return [*keys, *([self.tail_key] if self.tail_key else [])]


def pack_record(record: SessionRecord) -> bytes:
    return msgpack.packb(
        {
            "v": SESSION_RECORD_VERSION,
            "ns": record.ns,
            "tokens": record.tokens.astype("<u4").tobytes(),
            "kv_tokens": record.kv_tokens,
            "chunks": list(record.chunk_keys),
            "tail": record.tail_key,
            "updated": record.updated,
            "meta": record.meta,
        },
        use_bin_type=True,
    )


def unpack_record(session_id: str, raw: bytes) -> SessionRecord:
    """Parse a stored record; CorruptObjectError if it is not one."""
    try:
        d = msgpack.unpackb(raw, raw=False)
        if d.get("v") != SESSION_RECORD_VERSION:
            raise ValueError(f"record version {d.get('v')}")
        toks = np.frombuffer(d["tokens"], dtype="<u4").copy()
        return SessionRecord(
            session_id=session_id,
            ns=str(d["ns"]),
            tokens=toks,
            kv_tokens=int(d["kv_tokens"]),
            chunk_keys=tuple(str(k) for k in d["chunks"]),
            tail_key=None if d["tail"] is None else str(d["tail"]),
            updated=float(d["updated"]),
            meta=dict(d.get("meta") or {}),
        )
    except Exception as exc:
        raise CorruptObjectError(f"session record {session_id!r} is malformed: {exc}") from None
