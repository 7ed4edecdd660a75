"""The cost guard: a hit is loaded only where restoring it beats computing it (invariant
5, never slower than recompute: docs/ARCHITECTURE.md).

The workers measure two rates and report them with each step (specs.KVCloudWorkerMeta):
how many tokens per second their forward passes compute (passes of at least a chunk, with
no restore in them: device.PassClock), and how many bytes per second their restores get
from the store (restores that ended; a restore given up at its timeout counts the bytes
it got in the time it had, and caps the rate there: a store too slow to finish one
restore is measured as well). From them the scheduler
side prices each hit: restoring the chunks a load of tokens ``[local, end)`` pulls takes
their bytes over the restore rate; computing those tokens takes their count over the
prefill rate. The longest ``end`` (a chunk boundary, or the hit's own end) whose restore,
times ``cost_margin``, is at most its compute is loaded; the rest of the hit is computed.
A chunk vLLM's own cache partly holds is pulled whole for a few tokens, so a hit can pay
only from further on; and on a store whose rate is below the break-even nothing is loaded.

Before both rates are measured, everything is loaded (as before the guard), which is how
they get measured. Once the guard skips whole hits no restore runs, so the restore rate
would never be seen to recover: a hit every ``cost_reprobe_s`` without any report loads
its first chunk anyway (``cost_probes``).

Known limits, on the safe side: a pass's tokens include the decode tokens batched with
the prefill (a lower prefill rate than pure prefill: restores look better, as today), and
the restore rate is one figure per store, not per object size (a store slow only for large
objects is priced at its average).
"""

from __future__ import annotations

from collections.abc import Sequence


def paying_end(
    local: int,
    hit: int,
    chunk_tokens: int,
    chunks: Sequence[tuple[int, int]],
    prefill_rate: float,
    restore_rate: float,
    margin: float,
) -> int:
    """The end (token index) of the longest load of ``[local, end)``, ``end <= hit``, that
    is expected to take at most ``1 / margin`` of computing it; ``local`` when none does.
    ``chunks``: ``(position, bytes)`` of the stored chunks, in order; a load pulls every
    chunk overlapping it, whole. Ends are chunk boundaries and ``hit`` itself."""
    if restore_rate <= 0:
        return local
    c = chunk_tokens
    # (on vLLM's scheduler thread, once per hit: one pass over the chunks, the bytes a load
    # pulls growing as its end moves right, not a sum per end)
    overlapping = sorted((pos, size) for pos, size in chunks if (pos + 1) * c > local)
    ends = [*range((local // c + 1) * c, hit, c), hit]
    best, pulled, i = local, 0, 0
    for end in ends:
        while i < len(overlapping) and overlapping[i][0] * c < end:
            pulled += overlapping[i][1]
            i += 1
        if end > local and margin * pulled / restore_rate <= (end - local) / prefill_rate:
            best = end
    return best


def first_chunk_end(local: int, hit: int, chunk_tokens: int) -> int:
    """A probe's end: the rest of the chunk ``local`` falls in (the least a load pulls)."""
    return min(hit, (local // chunk_tokens + 1) * chunk_tokens)


def moved(rate: float | None, amount: float, seconds: float) -> float | None:
    """A moving average of a rate, a third of the way towards each new measurement (one
    slow restore or busy step does not flip every later decision)."""
    if amount <= 0 or seconds <= 0:
        return rate
    now = amount / seconds
    return now if rate is None else rate + (now - rate) / 3


def capped(rate: float | None, amount: float, seconds: float) -> float | None:
    """A rate no higher than ``amount / seconds``: a restore given up at its timeout got
    ``amount`` bytes in ``seconds`` (perhaps none: a rate of 0, nothing pays)."""
    if seconds <= 0:
        return rate
    bound = max(0.0, amount) / seconds
    return bound if rate is None else min(rate, bound)
