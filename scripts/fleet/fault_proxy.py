"""A TCP proxy that turns a healthy server into a sick one, for fault measurements.

Modes, switched at any time (``proxy.set_mode``):

- ``pass``: forwards both ways;
- ``slow``: adds ``delay`` seconds before forwarding each piece of a request (client → server);
- ``blackhole``: accepts connections and reads, never forwards or answers (a hung server, a
  dropped route); connections already open stop answering too;
- ``refuse``: nothing listens on the port (connection refused); open connections are reset;
- ``throttle``: forwards, but the server's answers reach the client at ``rate`` bytes per
  second at most (a store that is up but slow to deliver: a busy link, a far region).

One asyncio loop in a daemon thread; no dependency beyond the standard library.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import suppress

MODES = ("pass", "slow", "blackhole", "refuse", "throttle")


class FaultProxy:
    def __init__(
        self,
        target_port: int,
        target_host: str = "127.0.0.1",
        delay: float = 0.2,
        rate: float = 2e6,
    ):
        self.target = (target_host, target_port)
        self.delay = delay
        self.rate = rate  # bytes per second of answers in ``throttle`` mode
        self.mode = "pass"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._listen())

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._conns):
            w.transport.abort()  # reset: the client sees the connection die
        self._conns.clear()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        self.mode = mode
        if mode == "refuse":
            self._call(self._unlisten())
        else:
            self._call(self._listen())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            if self.mode == "blackhole":
                while await reader.read(65536):
                    pass
                return
            up_r, upstream_w = await asyncio.open_connection(*self.target)
            self._conns.add(upstream_w)
            await asyncio.gather(
                self._pump(reader, upstream_w, request=True),
                self._pump(up_r, writer, request=False),
            )
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (writer, upstream_w):
                if w is not None:
                    self._conns.discard(w)
                    with suppress(Exception):
                        w.close()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, request: bool
    ) -> None:
        while True:
            data = await src.read(65536)
            if not data:
                with suppress(Exception):
                    dst.write_eof()
                return
            while self.mode == "blackhole":  # hold everything, answer nothing
                await asyncio.sleep(0.05)
            if request and self.mode == "slow":
                await asyncio.sleep(self.delay)
            if not request and self.mode == "throttle":
                for i in range(0, len(data), 16384):  # paced in small pieces
                    piece = data[i : i + 16384]
                    dst.write(piece)
                    await dst.drain()
                    await asyncio.sleep(len(piece) / self.rate)
                continue
            dst.write(data)
            await dst.drain()

    def close(self) -> None:
        with suppress(Exception):
            self._call(self._unlisten())
        self._loop.call_soon_threadsafe(self._loop.stop)
