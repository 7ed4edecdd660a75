"""``s3://`` store bodies on the wire: a buffer sent as a PUT body without a copy, and a GET
body read as a stream straight from the socket."""

from __future__ import annotations

import http.client
import io
from collections.abc import Callable
from typing import Any

from ..errors import StoreError, StoreUnavailableError
from .base import Buffer

# the store's mapping of a botocore error to kvcloud's (S3Store._error): given, not imported,
# so this module sits below s3.py rather than beside it
ErrorMap = Callable[[str, str, Exception], StoreError]


class BufferBody(io.RawIOBase):
    """A seekable read-only file over a buffer (botocore sizes and rewinds it for retries)."""

    def __init__(self, data: Buffer) -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._mv) - self._pos))
        b[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._mv)


class BodyReader:
    """A GET body as a stream; transport failures mid-read become StoreUnavailableError, and
    the connection goes back to the pool when the block ends.

    When the body is a plain (not chunked, not content-encoded) HTTP response, reads go
    straight to the socket: urllib3's ``readinto`` reads into a temporary bytes object and
    copies it into the caller's buffer, which costs as much memory traffic as hashing the
    object; ``http.client``'s lands the bytes in place. A transfer that ends before its
    Content-Length is then reported as a broken transfer, exactly as urllib3 would.
    """

    def __init__(self, body: Any, key: str, url: str, error: ErrorMap) -> None:
        self._body = body
        self._key = key
        self._url = url
        self._error = error
        self._raw, self._sock = _socket_response(body)
        self._left = self._sock.length if self._sock is not None else 0

    def __enter__(self) -> BodyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._body.close()

    def _guard(self, fn: Any, arg: Any) -> Any:
        from botocore.exceptions import BotoCoreError

        try:
            return fn(arg)
        except BotoCoreError as exc:
            raise self._error("get", self._key, exc) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:  # transport errors
            raise StoreUnavailableError(
                f"get {self._key!r} from {self._url} broke off: {exc}"
            ) from exc

    def _advance(self, got: int, wanted: int) -> None:
        if got == 0 and wanted and self._left:
            raise StoreUnavailableError(
                f"get {self._key!r} from {self._url} broke off with {self._left} "
                "bytes of the body still to come"
            )
        self._left -= got
        if not self._left:
            # the whole body is in: the connection can serve the next request (urllib3
            # would do this itself had the bytes gone through it)
            self._raw.release_conn()

    def read(self, n: int = -1) -> bytes:
        if self._sock is None:
            return self._guard(self._body.read, None if n < 0 else n)
        if not self._left:
            return b""
        data: bytes = self._guard(self._sock.read, None if n < 0 else n)
        self._advance(len(data), n)
        return data

    def readinto(self, buf: Any) -> int:
        if self._sock is None:
            return self._guard(self._body.readinto, buf)
        if not self._left:
            return 0
        got: int = self._guard(self._sock.readinto, buf) or 0
        self._advance(got, len(buf))
        return got


def _socket_response(body: Any) -> tuple[Any, http.client.HTTPResponse | None]:
    """The urllib3 response under a botocore body and its ``http.client`` response, when
    bytes can be read from the latter as they are: nothing read yet, a known length, no
    chunked or content encoding. (None, None) otherwise, and reads go through botocore."""
    raw = getattr(body, "_raw_stream", None)
    sock = getattr(raw, "_fp", None)
    if (
        not isinstance(sock, http.client.HTTPResponse)
        or sock.chunked
        or sock.length is None
        or getattr(raw, "_fp_bytes_read", None) != 0
        or not callable(getattr(raw, "release_conn", None))
        or raw.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
    ):
        return None, None
    return raw, sock
