"""The storage-outage proxy: forwards, goes away (refused, open connections reset) and comes back on the
same address; armed, it goes away at the first snapshot upload, which it does not forward."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from elastic.testing.etcd_server import free_port
from tests.chaos.storage import StoreProxy, is_snapshot_upload


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[StoreProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = StoreProxy("127.0.0.1", free_port(), ("127.0.0.1", server.server_address[1])).start()
    yield p
    p.stop()
    server.shutdown()
    server.server_close()


def _roundtrip(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        return s.recv(4096)


def test_the_proxy_forwards_goes_away_and_comes_back_on_the_same_port(proxy: StoreProxy) -> None:
    assert _roundtrip(proxy.port, b"GET / HTTP/1.1\r\n\r\n") == b"GET / HTTP/1.1\r\n\r\n"
    open_conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    open_conn.sendall(b"x")
    assert open_conn.recv(1) == b"x"
    proxy.cut("test")
    assert proxy.cut_event.is_set() and not proxy.up
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    with pytest.raises(OSError):  # reset, or closed: nothing more comes through an open connection
        open_conn.sendall(b"y")
        if not open_conn.recv(1):
            raise ConnectionResetError
    open_conn.close()
    proxy.start()
    assert _roundtrip(proxy.port, b"again") == b"again"


def test_an_armed_proxy_cuts_at_the_first_snapshot_upload_and_drops_it(proxy: StoreProxy) -> None:
    manifest = b"PUT /b/job/step-000000000003/manifest.json HTTP/1.1\r\nHost: x\r\n\r\n"
    upload = b"PUT /b/job/step-000000000003/ab12cd34/skeleton.pt HTTP/1.1\r\nHost: x\r\n\r\n"
    assert is_snapshot_upload(upload) and not is_snapshot_upload(manifest)
    assert not is_snapshot_upload(b"PUT /b/job/.probe-0123456789ab HTTP/1.1\r\n")
    assert not is_snapshot_upload(b"GET /b/job/step-000000000003/ab12cd34/skeleton.pt HTTP/1.1\r\n")
    proxy.arm()
    assert _roundtrip(proxy.port, manifest) == manifest  # not a data upload: forwarded
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
        s.sendall(upload)
        try:
            assert s.recv(4096) == b""  # never echoed: the upload was dropped
        except ConnectionResetError:
            pass
    assert proxy.cut_event.wait(5) and "skeleton.pt" in proxy.cut_reason and proxy.cuts == 1
