"""Where the connector's copies run: the engine's device, its host staging, its streams.

On a GPU the KV cache lives in device memory and kvcloud's objects in host memory, so every
restore and save crosses the bus. Three things keep that off the forward pass's path:

- **pinned host staging**, so a copy between host and device is a DMA the host does not wait
  for (``non_blocking=True`` is only asynchronous from page-locked memory);
- **a side stream per direction**, so a restore's writes and a save's reads queue beside the
  forward pass's kernels instead of behind them;
- **events**, for the orderings that matter: a restore's writes begin only after the work
  already queued on the engine's stream (blocks handed to a new request may still be read or
  written by kernels of the step that freed them); a pass that a full CUDA graph may replay
  reads a restore in the step only after its writes (``after_loads``: no per-layer wait runs
  inside a replay); and a save's reads are over before any later kernel may overwrite the
  blocks (``after_save``), and before the uploader reads the host copy (``Fence.wait``).

On a device without streams (the CPU backend) every copy is synchronous and each of these is
a no-op: the same code path, tested here on CPU tensors, runs on CUDA tensors unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


class Fence:
    """A point in a stream's work; ``wait`` blocks the calling host thread until it is done.
    On a device without streams, work is done when issued: always passed."""

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


PASSED = Fence()


class Streams:
    """Side streams and pinned staging for one engine device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.has_streams = self.device.type == "cuda"
        if self.has_streams:
            self._load = torch.cuda.Stream(self.device)
            self._save = torch.cuda.Stream(self.device)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host staging the device copies to and from asynchronously (pinned on a GPU)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.has_streams)

    def mark(self) -> Fence:
        """On the forward thread: a fence after everything queued on the engine's stream."""
        if not self.has_streams:
            return PASSED
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Fence(event)

    @contextlib.contextmanager
    def loading(self, after: Fence) -> Iterator[None]:
        """On a load thread: run the block writes on the load stream, after ``after`` (the
        step that handed the blocks over), and return once they are done, so a restore
        reported finished is in the cache."""
        if not self.has_streams:
            yield
            return
        if after._event is not None:
            self._load.wait_event(after._event)
        with torch.cuda.stream(self._load):
            yield
        self._load.synchronize()

    def after_loads(self) -> None:
        """On the forward thread, before a pass that reads restores without a per-layer wait
        (a full CUDA graph replay): the engine's stream waits for every block write queued
        on the load stream so far. (``loading`` already synchronizes each write before it
        counts as written; this keeps the pass ordered after them on the device too.)"""
        if not self.has_streams:
            return
        event = torch.cuda.Event()
        event.record(self._load)
        torch.cuda.current_stream(self.device).wait_event(event)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """On the forward thread, after the pass (``wait_for_save``): read the step's save
        chunks out of their blocks on the save stream, once the pass's kernels (queued
        before) are done."""
        if not self.has_streams:
            yield
            return
        self._save.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._save):
            yield

    def after_save(self) -> Fence:
        """After the save reads: later kernels on the engine's stream wait for them
        (vLLM may hand the blocks to another request at the next schedule); the returned
        fence is passed once the host copies hold the KV (the uploader waits on it)."""
        if not self.has_streams:
            return PASSED
        event = torch.cuda.Event()
        event.record(self._save)
        torch.cuda.current_stream(self.device).wait_event(event)
        return Fence(event)


class PassClock:
    """Times forward passes (``begin`` before one, ``end`` after it), for the prefill rate
    the cost guard compares restores with. On a GPU the host returns from a pass as soon as
    its kernels are queued, so the time is taken between events on the engine's stream,
    read once they have passed (``take`` never waits for the device); on the CPU backend,
    the host clock."""

    def __init__(self) -> None:
        self._open: tuple[int, Any, Streams] | None = None
        self._ended: list[tuple[int, Any, Any]] = []  # (tokens, start, end) not yet taken

    def _now(self, streams: Streams) -> Any:
        if not streams.has_streams:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(streams.device))
        return event

    def begin(self, streams: Streams, tokens: int) -> None:
        self._open = (tokens, self._now(streams), streams)

    def cancel(self) -> None:
        self._open = None

    def end(self) -> None:
        if self._open is None:
            return
        tokens, start, streams = self._open
        self._open = None
        if len(self._ended) < 1000:  # bounded if nobody takes them
            self._ended.append((tokens, start, self._now(streams)))

    def take(self) -> tuple[int, float]:
        """Tokens and seconds of the passes ended (on the device too) since the last take."""
        tokens, seconds, waiting = 0, 0.0, []
        for item in self._ended:
            n, start, end = item
            if isinstance(end, float):
                seconds += end - start
            elif end.query():
                seconds += start.elapsed_time(end) / 1000
            else:
                waiting.append(item)
                continue
            tokens += n
        self._ended = waiting
        return tokens, seconds
