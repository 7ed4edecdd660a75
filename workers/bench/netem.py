"""A TCP proxy that shapes traffic: bandwidth cap, added latency, cut links.

Benchmarks put it between a client and a real server to measure what a slow or failing
network does (the cost model must notice a throttled store; fault tests cut links). It is a
plain socket relay with a shared token bucket for the server→client direction, where the
bytes of a pull flow.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kvcloud._closing import Closing


class _Bucket:
    def __init__(self) -> None:
        self.rate: float | None = None  # bytes/s; None = unlimited
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Account for n bytes; return how long the caller must sleep first."""
        with self._lock:
            if self.rate is None:
                return 0.0
            now = time.monotonic()
            # a burst of at most 64 KiB: enough for one read, not enough to hide the cap
            self._tokens = min(65536.0, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class ShapingProxy(Closing):
    """Listens on 127.0.0.1:<port> and relays every connection to ``target``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.latency = 0.0
        self._bucket = _Bucket()
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="netem-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rate(self, bytes_per_second: float | None) -> None:
        self._bucket.rate = bytes_per_second

    def cut(self) -> None:
        """Drop every connection and refuse new ones (a severed link)."""
        self._cut.set()
        with self._lock:
            for s in list(self._conns):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._conns.clear()

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, shaped: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if shaped:
                    delay = self._bucket.take(len(data)) + self.latency
                    if delay > 0:
                        time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
