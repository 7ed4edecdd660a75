"""Host staging for restores: a bounded ring of chunk-sized slots that every restore streams
through.

A pulled object lands in host memory (pinned on a GPU, so its copy into vLLM's blocks is a DMA)
before its layers are written into the blocks. Allocating that memory per step, for all of a
step's restores at once, made a 100k-token restore of an 8B model ask for ~12.5 GiB of pinned
memory on the forward thread, which PyTorch rounds up and keeps, and where a failed allocation
stopped the engine. Here the memory is allocated once, ``staging_mib`` at most (at least one
chunk), on the first load thread that needs it; a restore takes as many slots as it pulls chunks
at once and gives them back when those pulls have ended (every block write from them is done by
then: ``Streams.loading`` waits for each). A restore larger than the ring pulls its chunks in
groups, one group after another; one that cannot get a slot before its deadline is given up
like any late restore (recomputed).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from .device import Streams


class StagingRing:
    """``slots`` host buffers of one chunk each (as this rank holds a chunk)."""

    def __init__(
        self, streams: Streams, shape: tuple[int, ...], dtype: torch.dtype, budget_bytes: int
    ) -> None:
        self._streams, self.shape, self.dtype = streams, shape, dtype
        chunk = math.prod(shape) * dtype.itemsize
        self.slots = max(1, budget_bytes // chunk)
        self._buf: torch.Tensor | None = None
        self._free = list(range(self.slots))
        self._cond = threading.Condition()
        self.waits = 0  # times a restore waited for a slot (the ring too small for the load)

    def acquire(self, n: int, give_up: Callable[[], bool]) -> list[int] | None:
        """``n`` (at most ``slots``) free slots, waiting for them while ``give_up()`` is
        False; None once it is True. Allocates the ring on first use (on the caller's
        thread: a load thread, never the forward pass's)."""
        if not 0 < n <= self.slots:
            raise ValueError(f"{n} slots asked of a ring of {self.slots}")
        with self._cond:
            if self._buf is None:
                self._buf = self._streams.host_empty((self.slots, *self.shape), self.dtype)
            waited = False
            while len(self._free) < n:
                if give_up():
                    return None
                waited = True
                self._cond.wait(0.05)  # give_up reads a clock: look again now and then
            if waited:
                self.waits += 1
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def view(self, slot: int) -> torch.Tensor:
        """Slot ``slot``: ``[layers, 2, chunk_tokens, heads, dim]``."""
        assert self._buf is not None
        return self._buf[slot]

    def release(self, slots: list[int]) -> None:
        """Give slots back: only once nothing writes into them or reads from them any more."""
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


__all__ = ["StagingRing"]
