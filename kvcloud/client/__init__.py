"""KVCloud: the client — push, lookup and pull KV segments, save and resume sessions — and
how it is opened and closed.

The class is composed of one part per job, each stating the reliability rules (the
invariants in docs/ARCHITECTURE.md) it enforces next to the code that enforces them:

- ``base.py``: the state every part shares: backends, per-tenant keys, counters;
- ``push.py``: store chunks and register them (an object before its index entry);
- ``parts.py``: a chunk stored in parts (tensor-parallel heads, pipeline stages);
- ``pull.py``: lookup and pull (verify on read; a missing or corrupt object, or an
  unreachable backend, is a miss, not an error);
- ``sessions.py``: save, load and resume sessions (the record format is ``kvcloud/sessions.py``);
- ``results.py``: what the calls return (re-exported here).
"""

from __future__ import annotations

from typing import Any

from ..config import KVCloudConfig
from ..indexes.base import Index
from ..sessions import SessionRecord
from ..stores.base import ObjectStore
from .parts import PartsMixin
from .pull import PullMixin
from .push import PushMixin
from .results import ChunkRef, Match, PullResult, PushResult
from .sessions import SessionsMixin

__all__ = ["ChunkRef", "KVCloud", "Match", "PullResult", "PushResult", "SessionRecord"]


class KVCloud(SessionsMixin, PartsMixin, PushMixin, PullMixin):
    """The client. Thread-safe; use it as a context manager or call close()."""

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        store: str | ObjectStore | None = None,
        index: str | Index | None = None,
        *,
        secret: str | bytes | None = None,
        config: KVCloudConfig | None = None,
        **options: Any,
    ) -> KVCloud:
        """Open by URL (or with ready backends). Unset values come from the environment."""
        cfg = config or KVCloudConfig.from_env(
            store=store if isinstance(store, str) else None,
            index=index if isinstance(index, str) else None,
            secret=secret,
            **options,
        )
        if config is not None and secret is not None:
            cfg.secret = secret.encode() if isinstance(secret, str) else secret
        st = store if isinstance(store, ObjectStore) else cfg.open_store()
        try:
            ix = index if isinstance(index, Index) else cfg.open_index()
        except Exception:
            if not isinstance(store, ObjectStore):
                st.close()
            raise
        return cls(st, ix, cfg)

    @classmethod
    def from_env(cls, **options: Any) -> KVCloud:
        """KVCLOUD_STORE, KVCLOUD_INDEX, KVCLOUD_SECRET, … (see KVCloudConfig)."""
        return cls.open(**options)

    def close(self) -> None:
        try:
            self._flush_counters()
        finally:
            self.store.close()
            self.index.close()

    def __repr__(self) -> str:
        return f"KVCloud(store={self.store.url!r}, index={self.index.url!r})"
