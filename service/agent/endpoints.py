"""The agent's two HTTP servers, beside its assignment loop (:mod:`service.agent.node`): the job-log server
(``logs_port``: :class:`~service.agent.logs.LogServer`, which the controller reads with a bearer token of this
incarnation's, published with its address in the node's registration) and the ``/healthz`` server
(``health_port``: :class:`~service.agent.health.HealthServer`). Each runs only when its port is set.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Callable

from service.agent.health import HealthServer, HealthStatus
from service.agent.logs import LogServer
from service.core.config import AgentSettings

logger = logging.getLogger("service.agent.node")  # the lines' logger before the split

__all__ = ["AgentEndpoints", "EndpointError"]


class EndpointError(RuntimeError):
    """A server cannot start (its port is taken, its address unknown)."""


class AgentEndpoints:
    """Starts and stops the agent's log and health servers; the token and the address it names them by."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        # the job-log server's bearer token, new with each incarnation: the controller reads it, and the server's
        # address, from this node's registration
        self.logs_token = secrets.token_urlsafe(32)
        self.logs: LogServer | None = None
        self.health: HealthServer | None = None

    @property
    def logs_url(self) -> str | None:
        """Where the controller reaches this agent's log server: ``rdzv_host``, else a specific ``logs_host``,
        else 127.0.0.1 (one machine); None while it does not run."""
        if self.logs is None:
            return None
        s = self.settings
        host = s.rdzv_host or (s.logs_host if s.logs_host not in ("", "0.0.0.0", "::") else "127.0.0.1")
        try:
            if ipaddress.ip_address(host).version == 6:
                host = f"[{host}]"
        except ValueError:
            pass  # a host name
        return f"http://{host}:{self.logs.port}"

    def start_logs(self, runs: Callable[[str, int], bool]) -> None:
        """Serve the job logs (with ``logs_port``); ``runs(job id, generation)``: whether that log may grow."""
        s = self.settings
        if not s.logs_port or self.logs is not None:
            return
        try:
            server = LogServer(s.work_dir, s.node_name, self.logs_token, runs, s.logs_host, s.logs_port)
        except OSError as exc:
            raise EndpointError(f"cannot serve job logs on {s.logs_host}:{s.logs_port}: {exc.strerror or exc}") from exc
        self.logs = server.start()
        logger.info(
            "agent job logs on %s:%d (the controller reads them at %s)", s.logs_host, s.logs_port, self.logs_url
        )

    def close_logs(self) -> None:
        if self.logs is not None:
            self.logs.close()
            self.logs = None

    def start_health(self, healthy: Callable[[], HealthStatus]) -> None:
        """Serve ``/healthz`` (with ``health_port``), answered by ``healthy``."""
        port = self.settings.health_port
        if not port or self.health is not None:
            return
        self.health = HealthServer(healthy, port).start()

    def stop_health(self) -> None:
        if self.health is not None:
            self.health.stop()
            self.health = None
