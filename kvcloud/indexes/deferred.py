"""A background sender for the side effects of lookups: TTL renewals of hits and counter
increments, batched and sent off the request path by one daemon thread. Used by every index
whose lookups must not wait for a write (Redis, SQLite)."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence

from ..errors import IndexUnavailableError

log = logging.getLogger("kvcloud.index")

# Pending renewals (counted with repeats: lookups only append, the thread deduplicates) past
# which the background thread sends at once instead of waiting out its delay.
_SEND_AT_KEYS = 16_384
# Past this many (Redis slow or down for a while) new renewals are dropped: a missed renewal
# only means an entry may expire earlier than it would have. ~100 bytes a key.
_MAX_PENDING_KEYS = 65_536
# Seconds without work after which the background thread exits (a new one starts on demand).
_IDLE_EXIT = 30.0
# How often the background thread may log a failure (seconds), so an outage logs a line now
# and then instead of one per lookup.
_WARN_INTERVAL = 30.0


class Deferred:
    """Sends the side effects of lookups (TTL renewals of hits, counter increments) off the
    request path, from one daemon thread.

    ``submit`` appends to a list under a lock that is never held across I/O: the caller never
    waits for the network and never sees an exception. The thread wakes when the first item
    arrives, lets ``delay`` seconds of lookups accumulate, then sends them all as one batch
    (duplicate keys once). The delay is what keeps this cheap: a busy worker sends one batch
    per ``delay`` instead of one per lookup, so the thread rarely competes with the request
    path for the GIL and the server. A batch of _SEND_AT_KEYS goes out without waiting.
    ``flush`` cuts the delay short and waits until everything submitted before it was
    attempted; ``close`` flushes and stops the thread. The thread also exits after
    _IDLE_EXIT seconds without work; ``submit`` starts a new one when needed.

    When ``send`` fails with IndexUnavailableError (Redis unreachable or slow) the counters are
    kept for the next batch, since they would otherwise be lost, and renewals are dropped:
    they are only hints. Any other failure drops the batch. Either way it is logged, at most
    once per _WARN_INTERVAL. Renewals past ``max_keys`` pending are dropped (and logged).

    Counter names are strings (the index's named counters) or any hashable that ``send``
    maps to other bookkeeping (the Redis index's per-namespace tallies): both are increments
    that must not be lost, so both are kept for the next batch when a send fails.

    ``send`` is held weakly, so the thread does not keep an index that nobody closed alive.
    """

    def __init__(
        self,
        send: Callable[[list[Hashable], dict[Hashable, int]], None],
        name: str,
        *,
        delay: float = 0.05,
        max_keys: int = _MAX_PENDING_KEYS,
        retry_delay: float = 1.0,
    ) -> None:
        self._send_ref = weakref.WeakMethod(send)
        self._name = name
        self.delay = float(delay)
        self._max_keys = max_keys
        self._retry_delay = retry_delay
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._keys: list[Sequence[Hashable]] = []  # one sequence per lookup, deduplicated later
        self._n_keys = 0
        self._counters: dict[Hashable, int] = {}
        self._first_at = 0.0  # monotonic time of the oldest pending submission
        self._submitted = 0  # submissions accepted so far (a retry counts as a new one)
        self._attempted = 0  # submissions whose batch has been sent (or has failed)
        self._urgent = False  # a flush is waiting: skip the delay
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_warning = 0.0  # monotonic

    def _check_fork(self) -> None:
        # A forked child inherits the pending items (its parent sends them) and a lock some
        # parent thread may hold, but not the thread: start over empty.
        if os.getpid() != self._pid:
            self._reset()

    def _pending(self) -> bool:
        return bool(self._keys or self._counters)

    def _add_counters(self, counters: Mapping[Hashable, int]) -> None:
        for name, n in counters.items():
            self._counters[name] = self._counters.get(name, 0) + int(n)

    def submit(self, keys: Sequence[Hashable], counters: Mapping[Hashable, int] | None) -> None:
        dropped = 0
        try:
            self._check_fork()
            with self._cond:
                was_idle = not self._pending()
                if keys:
                    if self._n_keys + len(keys) <= self._max_keys:
                        self._keys.append(keys)
                        self._n_keys += len(keys)
                        if self._n_keys >= _SEND_AT_KEYS > self._n_keys - len(keys):
                            self._cond.notify_all()  # a full batch: no need to wait
                    else:
                        dropped = len(keys)
                if counters:
                    self._add_counters(counters)
                if dropped < len(keys) or counters:
                    self._submitted += 1
                    if was_idle:
                        # Wake the thread only for the first item of a batch; the rest
                        # just join the list while it waits out the delay.
                        self._first_at = time.monotonic()
                        self._cond.notify_all()
                    self._ensure_thread()
        except Exception as exc:  # the request path must not fail for a side effect
            self._warn(f"lookup side effects dropped: {type(exc).__name__}: {exc}")
        if dropped:
            self._warn(f"{dropped} TTL renewals dropped: too many pending (Redis slow?)")

    def _ensure_thread(self) -> None:
        # Called with the lock held. The thread clears self._thread itself, under the lock,
        # when it exits, so an item added after that starts a new thread.
        if self._thread is None:
            self._stopping = False
            thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            thread.start()
            self._thread = thread

    def flush(self, timeout: float) -> bool:
        """Send what is pending now and wait until it was attempted; False on timeout."""
        self._check_fork()
        with self._cond:
            target = self._submitted
            if self._attempted >= target:
                return True
            self._urgent = True
            self._ensure_thread()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._attempted >= target, timeout)

    def stop(self) -> None:
        """Let the thread exit once nothing is pending, without waiting for it.

        Runs from a GC finalizer, possibly on the thread itself while it holds the lock, so
        it never blocks on the lock: without it the flag is still seen at the next wake-up.
        """
        self._stopping = True
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            log.warning(
                "%s: pending TTL renewals and counters not sent in %.1fs", self._name, timeout
            )
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                self._cond.notify_all()

    def _run_once(self) -> bool:
        """Wait for a batch and send it; False when the thread should exit."""
        with self._cond:
            while not self._pending():
                idle = self._stopping or not self._cond.wait(_IDLE_EXIT)
                if idle and not self._pending():
                    self._thread = None  # under the lock: a later submit starts a new one
                    return False
            # Let the batch fill for `delay` after its first item (bounded: a renewal lands
            # within delay + one round trip of its lookup).
            while not (self._urgent or self._stopping or self._n_keys >= _SEND_AT_KEYS):
                left = self._first_at + self.delay - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            lists, self._keys, self._n_keys = self._keys, [], 0
            counters, self._counters = self._counters, {}
            upto, self._urgent = self._submitted, False
        # Deduplicated, in first-seen order, outside the lock.
        keys = list(dict.fromkeys(key for part in lists for key in part))
        retry = False
        send = self._send_ref()
        try:
            if send is None:
                return False  # the index is gone without close(): nothing to send with
            send(keys, counters)
        except IndexUnavailableError as exc:
            retry = bool(counters)
            self._warn(f"{len(keys)} TTL renewals not sent: {exc}")
        except Exception as exc:  # a daemon thread has no caller to raise to
            self._warn(f"{len(keys)} TTL renewals and counters {counters} not sent: {exc}")
        finally:
            del send
        with self._cond:
            if retry and not self._stopping:
                if not self._pending():
                    self._first_at = time.monotonic() + self._retry_delay  # do not spin
                self._add_counters(counters)
                self._submitted += 1  # so that a later flush waits for the retry
            elif retry:
                log.warning("%s: counters lost on close: %s", self._name, counters)
            self._attempted = max(self._attempted, upto)
            self._cond.notify_all()
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + _WARN_INTERVAL
            log.warning("%s: %s", self._name, message)
        else:
            log.debug("%s: %s", self._name, message)


__all__ = ["Deferred"]
