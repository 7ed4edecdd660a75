"""The object-store interface. Every backend implements it and passes tests/contracts."""

from __future__ import annotations

import contextlib
import io
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .._closing import Closing
from ..errors import StoreError

Buffer = bytes | bytearray | memoryview
#: an object given as the buffers that make it up, in order; ``put`` stores their
#: concatenation, and a store that can write scattered buffers never joins them
BufferParts = tuple[Buffer, ...] | list[Buffer]


def join_parts(data: Buffer | BufferParts) -> Buffer:
    """The object's bytes as one buffer (no copy when it already is one, or one part)."""
    if not isinstance(data, tuple | list):
        return data
    if len(data) == 1:
        return data[0]
    return b"".join(data)


_KEY_RE = re.compile(r"^[0-9A-Za-z_.-]+(/[0-9A-Za-z_.-]+)*$")


def validate_key(key: str) -> str:
    """Reject keys that could escape a store's root or confuse a listing.

    Keys come from the index, which a compromised peer could write to; a key like
    ``../../etc/passwd`` must never reach the filesystem or another bucket prefix.
    """
    if (
        not isinstance(key, str)
        or len(key) > 512
        or not _KEY_RE.match(key)
        or any(part in (".", "..") for part in key.split("/"))
    ):
        raise StoreError(f"invalid object key {str(key)[:80]!r}")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # store-relative, as passed to put()
    size: int
    last_modified: float  # unix seconds


class ObjectStore(Closing, ABC):
    """Immutable, content-addressed objects under store-relative keys like ``ns/ab/abcd…``.

    Keys are made of ``[0-9a-zA-Z._-]`` segments joined by ``/``. Implementations must be
    thread-safe. ``put`` is create-only: writing a key that exists is a no-op that returns
    False (content addressing makes the bytes identical).
    """

    #: URL with any credentials removed, safe to log and print
    url: str = ""

    def __init__(self, max_workers: int = 16) -> None:
        self.max_workers = max(1, int(max_workers))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- required ---------------------------------------------------------------------------

    @abstractmethod
    def put(self, key: str, data: Buffer | BufferParts) -> bool:
        """Store ``data`` (one buffer, or a tuple or list of buffers to concatenate) under
        ``key`` if absent. True if written now, False if it existed."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes. Raises ObjectNotFoundError if absent."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and mtime of the object, or None if absent."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent keys are not an error."""

    @abstractmethod
    def touch(self, key: str) -> bool:
        """Set the object's modification time to now; False if it does not exist.

        A push that finds its object already stored (written earlier, maybe orphaned) touches
        it before registering an entry, so gc's grace period protects it from deletion.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (any order)."""

    # -- provided ---------------------------------------------------------------------------

    def open_read(self, key: str) -> AbstractContextManager[Any]:
        """A readable stream of the object (``read(n)``, ``readinto(buf)``), for decoding
        straight into its destination. Raises ObjectNotFoundError if absent. Stores that
        can stream override this; the default buffers the whole object."""
        return contextlib.nullcontext(io.BytesIO(self.get(key)))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The store's own pool for parallel transfers, sized like its connection pool."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="kvcloud-store"
                )
            return self._pool

    def prewarm(self) -> None:
        """Start every pool thread now, so the first parallel pull does not pay for
        spawning them (tens of milliseconds on a request path)."""
        gate = threading.Barrier(self.max_workers + 1)

        def wait() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                gate.wait(timeout=5)

        futures = [self.executor.submit(wait) for _ in range(self.max_workers)]
        with contextlib.suppress(threading.BrokenBarrierError):
            gate.wait(timeout=5)
        for f in futures:
            f.result()

    def get_many(self, keys: Sequence[str]) -> list[bytes | BaseException]:
        """Fetch in parallel. Results are in key order; a failure is returned, not raised."""
        if len(keys) <= 1:
            return [self._get_or_error(k) for k in keys]
        return list(self.executor.map(self._get_or_error, keys))

    def put_many(
        self, items: Sequence[tuple[str, Buffer | BufferParts]]
    ) -> list[bool | BaseException]:
        """Store in parallel; results in order, a failure is returned, not raised."""
        if len(items) <= 1:
            return [self._put_or_error(kv) for kv in items]
        return list(self.executor.map(self._put_or_error, items))

    def _get_or_error(self, key: str) -> bytes | BaseException:
        try:
            return self.get(key)
        except Exception as exc:  # handed back to the caller, which decides per key
            return exc

    def _put_or_error(self, item: tuple[str, Buffer | BufferParts]) -> bool | BaseException:
        try:
            return self.put(item[0], item[1])
        except Exception as exc:
            return exc

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
