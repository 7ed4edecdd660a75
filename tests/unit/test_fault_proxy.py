"""The fault proxy's throttle mode (scripts/fleet/fault_proxy.py), which the cost-guard benchmark
uses as a store slower than recompute: answers are paced to the set rate, requests are not."""

from __future__ import annotations

import socket
import threading
import time

from scripts.fleet.fault_proxy import FaultProxy


def test_throttle_paces_answers_to_the_rate() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    size = 600_000

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(16)
        conn.sendall(b"x" * size)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    proxy = FaultProxy(server.getsockname()[1], rate=2e6)
    try:
        proxy.set_mode("throttle")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(b"get")
            t0, got = time.monotonic(), 0
            while chunk := client.recv(65536):
                got += len(chunk)
            seconds = time.monotonic() - t0
        assert got == size  # everything arrives, in order of size
        assert seconds >= size / 2e6 * 0.9  # no faster than 2 MB/s (0.3 s)
        assert seconds < 5  # and not stalled
    finally:
        proxy.close()
        server.close()
