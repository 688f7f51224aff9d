"""The agent's job-log server: ``GET /jobs/<job id>/logs`` over plain HTTP, for the controller to proxy.

The agent writes each torchrun's output to ``<work dir>/jobs/<job id>/g<generation>/<node>.log``; this server
reads those files and nothing else. Every request needs ``Authorization: Bearer <token>`` (a random token per
agent incarnation, published with the node's registration in etcd, compared in constant time): anything
else gets 401 before the path is even looked at.

Query parameters:

* ``generation=G``: that generation's log; without it the newest generation present on this node.
* ``offset=N``: start at byte ``N`` of the file (``offset=0``: the whole file); without it
* ``tail=N``: start ``N`` bytes before the end (default :data:`DEFAULT_TAIL`, 1 MiB; ``tail=0``: at the end),
  cut forward to the next line start so that the first line is whole.
* ``follow=1``: after what is there, keep sending what is appended, until the job's torchrun on this node
  (that generation's) no longer runs and the file is sent to its end, or the client goes away. Without it,
  the file up to its size at the time of the request.

Answers are ``text/plain`` (the log's bytes as written), with ``X-Etrain-Generation`` and ``X-Etrain-Offset``
(the byte the body starts at). 404: no such log; 400: a malformed job id, generation or number. Job ids and
generations are checked against strict patterns and the resolved path must lie inside the jobs directory, so
no request reaches another file (a symlink a job planted included).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TAIL", "JOB_ID_PATTERN", "MAX_CONNECTIONS", "REQUEST_TIMEOUT", "LogServer", "log_path"]

#: bytes from the end of a log sent when the request names no ``offset`` (nor ``tail``)
DEFAULT_TAIL = 1 << 20
#: what a job id looks like (``<name>-<hex>``, see service/api/routes/jobs.py): no dot, no slash
JOB_ID_PATTERN = r"^[a-z0-9](?:[-a-z0-9]{0,62}[a-z0-9])?$"
_JOB_ID = re.compile(JOB_ID_PATTERN)
_NUMBER = re.compile(r"^[0-9]{1,15}$")
_GENERATION_DIR = re.compile(r"^g([0-9]{1,9})$")
_PATH = re.compile(r"^/jobs/([^/]+)/logs$")
_CHUNK = 64 * 1024
_IDLE_WAIT = 0.25  # seconds between looks at a followed file that has not grown
#: seconds a connection may take to send its request, and a send to the client may block
REQUEST_TIMEOUT = 10.0
#: connections served at once (each a thread; the controller holds one per followed log of this node)
MAX_CONNECTIONS = 64
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 26\r\n"
    b"Connection: close\r\n\r\ntoo many open connections\n"
)

Running = Callable[[str, int], bool]
"""``(job id, generation) -> bool``: whether that generation's torchrun still runs on this node."""


def log_path(work_dir: Path, job_id: str, generation: int, node: str) -> Path:
    """Where the agent writes one generation's torchrun output (the one place that names this layout)."""
    return work_dir / "jobs" / job_id / f"g{generation}" / f"{node}.log"


class _BadRequest(Exception):
    pass


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: one more is answered 503 and closed at once
    (never a thread of its own)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        """Connections being served now (each with its thread)."""
        return self._open

    def _count(self, delta: int) -> None:
        with self._open_lock:
            self._open += delta

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            logger.warning(
                "logs: refusing a connection from %s: %d already open", client_address[0], self._max_connections
            )
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._count(1)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._count(-1)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._count(-1)
            self._slots.release()


class LogServer:
    """Serves the job logs under ``work_dir`` of node ``node`` to bearers of ``token`` on ``host:port``
    (``port`` 0: any free one, see :attr:`port`). ``running`` tells when a followed log is complete."""

    def __init__(
        self,
        work_dir: Path,
        node: str,
        token: str,
        running: Running,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not token:
            raise ValueError("the log server needs a token")
        self.work_dir = work_dir
        self.node = node
        self._token = token.encode()
        self._running = running
        self._closing = threading.Event()
        self.request_timeout = request_timeout
        self._server = _Server((host, port), self._handler(), max_connections)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def open_connections(self) -> int:
        """Requests being served now (a followed log holds its connection until it ends)."""
        return self._server.open_connections

    def start(self) -> LogServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-logs", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting; streams in progress end at their next look at the file."""
        self._closing.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread = None
        self._server.server_close()

    # -- the request's parts -------------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        scheme, _, presented = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self._token)

    def _jobs_root(self) -> Path:
        return (self.work_dir / "jobs").resolve()

    def _inside(self, path: Path) -> Path | None:
        """``path`` resolved, if it is a regular file inside the jobs directory."""
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not real.is_relative_to(self._jobs_root()) or not real.is_file():
            return None
        return real

    def newest_generation(self, job_id: str) -> int | None:
        """The highest generation of ``job_id`` with a log of this node, or None."""
        try:
            entries = list(os.scandir(self.work_dir / "jobs" / job_id))
        except OSError:
            return None
        found = [int(m.group(1)) for e in entries if (m := _GENERATION_DIR.match(e.name))]
        for generation in sorted(found, reverse=True):
            if self._inside(log_path(self.work_dir, job_id, generation, self.node)) is not None:
                return generation
        return None

    def find(self, job_id: str, generation: int | None) -> tuple[Path, int] | None:
        """The log file and its generation, or None (404)."""
        if generation is None:
            generation = self.newest_generation(job_id)
            if generation is None:
                return None
        path = self._inside(log_path(self.work_dir, job_id, generation, self.node))
        return (path, generation) if path is not None else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            # the socket's timeout: a connection that sends no (whole) request in time, or a client that stops
            # reading, is dropped and its thread ends
            timeout = server.request_timeout

            def do_GET(self) -> None:
                if not server.authorized(self.headers.get("Authorization")):
                    self._error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
                    return
                url = urlsplit(self.path)
                route = _PATH.match(url.path)
                if route is None:
                    self._error(404, "not found")
                    return
                try:
                    self._serve(route.group(1), parse_qs(url.query))
                except _BadRequest as exc:
                    self._error(400, str(exc))
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    pass  # the client went away, or stopped reading

            def _serve(self, job_id: str, query: dict[str, list[str]]) -> None:
                if not _JOB_ID.match(job_id):
                    raise _BadRequest(f"not a job id: {job_id[:80]!r}")
                generation = _number(query, "generation")
                if generation is not None and generation < 1:
                    raise _BadRequest("generation: must be at least 1")
                offset, tail = _number(query, "offset"), _number(query, "tail")
                follow = (query.get("follow") or ["0"])[-1].lower() in ("1", "true", "yes")
                found = server.find(job_id, generation)
                if found is None:
                    which = f"generation {generation}" if generation is not None else "any generation"
                    self._error(404, f"no log of job {job_id} ({which}) on node {server.node}")
                    return
                path, generation = found
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    start = _start(fh, size, offset, DEFAULT_TAIL if tail is None else tail)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("X-Etrain-Generation", str(generation))
                    self.send_header("X-Etrain-Offset", str(start))
                    self.send_header("Cache-Control", "no-store")
                    if not follow:
                        self.send_header("Content-Length", str(max(size - start, 0)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    fh.seek(start)
                    if follow:
                        self._follow(fh, job_id, generation)
                    else:
                        _copy(fh, self.wfile, max(size - start, 0))

            def _follow(self, fh: BinaryIO, job_id: str, generation: int) -> None:
                while True:
                    chunk = fh.read(_CHUNK)
                    if chunk:
                        self.wfile.write(chunk)
                        continue
                    if server._closing.is_set() or not server._running(job_id, generation):
                        # nothing is written once the torchrun is gone: what is left is the end
                        while chunk := fh.read(_CHUNK):
                            self.wfile.write(chunk)
                        return
                    if self._client_gone():
                        return

            def _client_gone(self) -> bool:
                """Waits up to the idle interval; True when the client closed its end."""
                sock = self.connection
                try:
                    readable, _, _ = select.select([sock], [], [], _IDLE_WAIT)
                    if not readable:
                        return False
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        return True
                except OSError:
                    return True
                server._closing.wait(_IDLE_WAIT)  # the client sent more (ignored): do not spin
                return False

            def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
                body = f"{message}\n".encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("logs: " + format, *args)

        return Handler


def _number(query: dict[str, list[str]], name: str) -> int | None:
    values = query.get(name)
    if not values:
        return None
    if not _NUMBER.match(values[-1]):
        raise _BadRequest(f"{name}: not a non-negative integer")
    return int(values[-1])


def _start(fh: BinaryIO, size: int, offset: int | None, tail: int) -> int:
    """The byte to start at: ``offset``, else ``tail`` bytes before the end moved to the next line start."""
    if offset is not None:
        return min(offset, size)
    start = max(size - tail, 0)
    if start == 0 or tail == 0:
        return start
    fh.seek(start - 1)
    window = fh.read(min(tail, _CHUNK) + 1)
    newline = window.find(b"\n")
    return start + newline if newline >= 0 else start


def _copy(fh: BinaryIO, out: BufferedIOBase, length: int) -> None:
    while length > 0:
        chunk = fh.read(min(_CHUNK, length))
        if not chunk:
            return
        out.write(chunk)
        length -= len(chunk)
