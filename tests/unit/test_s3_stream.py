"""S3 GET bodies read straight from the socket: the bytes, the connection going back to the
pool, and a cut-off transfer reported as a store outage (not as a corrupt object)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvcloud.errors import StoreUnavailableError
from kvcloud.stores import S3Config, S3Store

BODY = bytes(range(256)) * 4096  # 1 MiB: several reads into the caller's buffer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    encoding = ""  # Content-Encoding to announce
    short_by = 0  # bytes the body falls short of its Content-Length


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so connection reuse is visible
    server: _Server

    def setup(self) -> None:
        super().setup()
        type(self.server).connections += 1

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        if self.server.encoding:
            self.send_header("Content-Encoding", self.server.encoding)
        self.end_headers()
        self.wfile.write(BODY[: len(BODY) - self.server.short_by])
        if self.server.short_by:
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Server]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    _Server.connections = 0
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _store(srv: _Server) -> S3Store:
    host, port = srv.server_address[:2]
    return S3Store(S3Config(bucket="bkt", endpoint_url=f"http://{host}:{port}", max_attempts=1))


def _read_all(reader: Any) -> bytes:
    out = bytearray(len(BODY))
    head = reader.read(10)
    view = memoryview(out)[len(head) :]
    out[: len(head)] = head
    while view:
        got = reader.readinto(view[: 256 * 1024])
        assert got
        view = view[got:]
    assert reader.read(1) == b""
    return bytes(out)


def test_a_streamed_body_is_read_whole_and_its_connection_reused(server: _Server) -> None:
    with _store(server) as store:
        for _ in range(3):
            with store.open_read("ns/ab/obj") as reader:
                assert _read_all(reader) == BODY
        assert store.get("ns/ab/obj") == BODY
    # every request went over the first connection: each body released it to the pool
    assert server.connections == 1


def test_a_content_encoded_body_goes_through_botocore(server: _Server) -> None:
    server.encoding = "identity, br"  # not something to read raw; urllib3 does not decode br
    with _store(server) as store, store.open_read("ns/ab/obj") as reader:
        assert reader._sock is None
        assert _read_all(reader) == BODY


def test_a_cut_off_body_is_a_store_outage(server: _Server) -> None:
    server.short_by = 1000
    with _store(server) as store, store.open_read("ns/ab/obj") as reader:
        assert reader._sock is not None
        with pytest.raises(StoreUnavailableError, match="broke off"):
            _read_all(reader)
