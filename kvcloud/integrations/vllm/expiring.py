"""A bounded memory of keys until a deadline: the objects a restore found bad, not offered
again for ``failure_memory`` seconds, on the scheduler side and on the worker side alike."""

from __future__ import annotations

# Past this many keys, the expired ones are forgotten at the next ``add``: a store failing
# for hours must not grow it without bound, and a scan per add is too much for a hot path.
PRUNE_AT = 4096


class Expiring:
    """Keys remembered until a time on the caller's clock. Not thread-safe: callers hold
    their own lock where threads share one."""

    def __init__(self, prune_at: int = PRUNE_AT) -> None:
        self._until: dict[str, float] = {}
        self._prune_at = prune_at

    def add(self, key: str, until: float, now: float) -> None:
        self._until[key] = until
        if len(self._until) > self._prune_at:
            self._until = {k: t for k, t in self._until.items() if t > now}

    def holds(self, key: str, now: float) -> bool:
        """Is ``key`` remembered at ``now``? An expired key is forgotten here."""
        until = self._until.get(key)
        if until is None:
            return False
        if until <= now:
            del self._until[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._until)
