"""The chaos job's checkpoint store, which the runner can take away: a real S3-compatible server (moto, its
own process on loopback) behind a TCP proxy of the runner's own.

The workers reach S3 only through the proxy (``FSSPEC_S3_ENDPOINT_URL`` in the job's environment: fsspec
hands it to s3fs); the runner's own checks go to moto directly. A storage outage is the proxy going away:
its listening socket is closed (new connections are refused, as by a stopped server) and every open
connection is reset; moto and the objects it holds in memory stay as they were, so when the proxy listens
again on the same address the store is back with its data, as a restarted server with durable storage
would be. :meth:`StoreProxy.arm` cuts at the moment a matching request (a snapshot's data upload) arrives,
dropping it: the outage then begins with a save in flight.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["StoreProxy", "is_snapshot_upload"]

logger = logging.getLogger(__name__)

_BUFFER = 1 << 16


def is_snapshot_upload(head: bytes) -> bool:
    """A client chunk that starts the upload of a snapshot's data (a PUT into a ``step-<n>`` directory,
    not its manifest: the save is then in flight, not yet committed)."""
    if not head.startswith(b"PUT "):
        return False
    line = head.split(b"\r\n", 1)[0]
    return b"/step-" in line and b"manifest" not in line


def _reset(sock: socket.socket) -> None:
    """Close with RST (linger 0): the peer sees the connection reset, as when a server process dies."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)  # wakes a thread blocked in recv without sending a FIN
    with contextlib.suppress(OSError):
        sock.close()


class StoreProxy:
    """A TCP proxy from ``(host, port)`` to ``target``, one thread per direction and connection."""

    def __init__(self, host: str, port: int, target: tuple[str, int]) -> None:
        self.host, self.port, self.target = host, port, target
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._trigger: Callable[[bytes], bool] | None = None
        self.cut_event = threading.Event()
        self.cut_reason = ""
        self.cuts = 0
        self.connections = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def up(self) -> bool:
        return self._listener is not None

    # -- up and down ---------------------------------------------------------------------------------
    def start(self) -> StoreProxy:
        """Listen (again) on the same address; retries for a while if the port is still taken."""
        deadline = time.monotonic() + 10
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, self.port))
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sock.listen(128)
        sock.settimeout(0.2)
        with self._lock:
            self._listener = sock
            self.cut_event.clear()
        self._accepting = threading.Thread(target=self._accept, args=(sock,), daemon=True, name="store-proxy")
        self._accepting.start()
        return self

    def cut(self, reason: str = "cut") -> None:
        """Stop listening and reset every open connection (idempotent)."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
            self._trigger = None
            if listener is not None:
                self.cuts += 1
                self.cut_reason = reason
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        for conn in conns:
            _reset(conn)
        if self._accepting is not None and self._accepting is not threading.current_thread():
            self._accepting.join(timeout=2)
        if listener is not None:
            self.cut_event.set()
            logger.info("store proxy %s: down (%s)", self.endpoint_url, reason)

    def arm(self, trigger: Callable[[bytes], bool] = is_snapshot_upload) -> None:
        """Cut as soon as a client sends a chunk for which ``trigger`` holds (that chunk is dropped)."""
        with self._lock:
            self._trigger = trigger

    def stop(self) -> None:
        self.cut("stopped")

    # -- forwarding ----------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while True:
            with self._lock:
                if self._listener is not listener:
                    return
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    _reset(client)
                    _reset(upstream)
                    return
                self._conns |= {client, upstream}
                self.connections += 1
            for src, dst, from_client in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, from_client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(_BUFFER)
                if not data:
                    break
                if from_client:
                    trigger = self._trigger
                    if trigger is not None and trigger(data):
                        line = data.split(b"\r\n", 1)[0].decode("latin-1", "replace")
                        self.cut(f"during {line[:160]}")
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            for sock in (src, dst):  # one side closed (or a cut reset both): the connection is over
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
