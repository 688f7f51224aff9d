"""The agent's health endpoint: ``GET /healthz`` over plain HTTP, for the pod's liveness probe.

:class:`HealthServer` serves whatever its ``status`` callable answers (``(ok, body)``: 200 or 503 with the body
as JSON; any other path is 404); the agent passes its :meth:`~service.agent.node.NodeAgent.healthy`, which
:func:`judge_health` decides. ``status`` must never wait for the agent's loop: a probe that hangs kills the pod.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

__all__ = ["HealthServer", "HealthStatus", "judge_health"]

#: ``(ok, body)``: what ``/healthz`` answers (200 if ok, else 503; the body as JSON).
HealthStatus = tuple[bool, dict[str, object]]

_MIN_STALE_S = 10.0  # a loop silent for longer than max(lease TTL, this) is stale


def judge_health(
    node: str, *, registered: bool, running: int, stopping: int, since_loop_s: float, lease_ttl_s: float
) -> HealthStatus:
    """The agent's health: registered (its lease kept), and its loop ran within ``max(lease_ttl_s, 10)``
    seconds or is busy stopping a torchrun (a stop is bounded by the grace and a kill, so not stale).

    The body counts jobs, never names them: the port answers anyone who can reach it."""
    stale = since_loop_s > max(lease_ttl_s, _MIN_STALE_S)
    ok = registered and (stopping > 0 or not stale)
    return ok, {"status": "ok" if ok else "unhealthy", "node": node, "jobs": running, "stopping": stopping}


class HealthServer:
    """``/healthz`` on ``host:port``, answered from ``status()``; :meth:`start` serves it from a daemon thread,
    :meth:`stop` shuts it down and closes the socket. Binding raises :class:`OSError` (at :meth:`start`)."""

    def __init__(self, status: Callable[[], HealthStatus], port: int, host: str = "0.0.0.0") -> None:
        self._status = status
        self._host = host
        self._port = port
        self._server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        """The port served (the bound one while serving: ``port=0`` picks a free one)."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def serving(self) -> bool:
        return self._server is not None

    def start(self) -> HealthServer:
        if self._server is not None:
            return self
        status = self._status

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/healthz":
                    self.send_error(404)
                    return
                ok, body = status()
                data = json.dumps(body).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("health: " + format, *args)

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        threading.Thread(target=self._server.serve_forever, name="agent-health", daemon=True).start()
        logger.info("agent health endpoint on port %d", self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
