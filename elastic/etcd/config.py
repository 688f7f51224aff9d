"""Connection settings for an etcd v3 cluster: the one way from what a user names to an :class:`EtcdConfig`.

:class:`EtcdOptions` is the connection as named by flags, ``--rdzv-conf`` or the workers' ``ETRAIN_ETCD_*``
variables (an endpoint list, files, a user); its :meth:`EtcdOptions.config` is the one builder of the
:class:`EtcdConfig` a client uses, and :func:`read_password_file` the one reader of a password file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

__all__ = [
    "CONNECT_TIMEOUT",
    "OP_TIMEOUT",
    "REQUEST_TIMEOUT",
    "EtcdConfig",
    "EtcdOptions",
    "parse_endpoints",
    "read_password_file",
]

_DEFAULT_PORT = 2379
#: The timeouts' defaults (the one home: ``RendezvousConf``'s and the service's flags come from here).
REQUEST_TIMEOUT = timedelta(seconds=5)  # one gRPC call
OP_TIMEOUT = timedelta(seconds=30)  # one operation, retries across endpoints included
CONNECT_TIMEOUT = timedelta(seconds=5)  # the start-up reachability check


def parse_endpoints(spec: str) -> tuple[tuple[str, int], ...]:
    """Parse ``"h1:2379,h2:2379"`` (schemes ``http://``/``https://`` allowed) into (host, port) pairs."""
    out: list[tuple[str, int]] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if item.startswith("["):  # [::1]:2379
            host, _, rest = item[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else _DEFAULT_PORT
        elif item.count(":") == 1:
            host, port_s = item.split(":")
            try:
                port = int(port_s)
            except ValueError as exc:
                raise ValueError(f"invalid etcd endpoint {raw.strip()!r}: port is not a number") from exc
        else:
            host, port = item, _DEFAULT_PORT
        if not host:
            raise ValueError(f"invalid etcd endpoint {raw.strip()!r}: no host")
        if not 0 < port < 65536:
            raise ValueError(f"invalid etcd endpoint {raw.strip()!r}: port out of range")
        out.append((host, port))
    if not out:
        raise ValueError("no etcd endpoint given")
    return tuple(out)


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach one etcd cluster.

    ``op_timeout`` bounds each operation including retries across endpoints; ``request_timeout`` bounds
    one gRPC call; ``connect_timeout`` bounds the start-up reachability check.
    """

    endpoints: tuple[tuple[str, int], ...]
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    request_timeout: timedelta = REQUEST_TIMEOUT
    op_timeout: timedelta = OP_TIMEOUT
    connect_timeout: timedelta = CONNECT_TIMEOUT

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.cert_key is None):
            raise ValueError("etcd TLS: cert and cert_key must be given together")
        if self.cert is not None and self.ca_cert is None:
            raise ValueError("etcd TLS: a client certificate needs ca_cert as well")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth: user and password must be given together")
        if self.user is not None and self.ca_cert is None:
            raise ValueError(
                "etcd auth: a user and password need TLS (ca_cert): over plain gRPC the password travels in clear"
            )

    @classmethod
    def from_options(cls, endpoints: str, options: Mapping[str, str | None] | None = None) -> EtcdConfig:
        """Build from an endpoint list and string options (``ca_cert``, ``cert``, ``cert_key``, ``user``,
        ``password``, ``password_file``, ``request_timeout``, ``op_timeout``, ``connect_timeout`` in seconds;
        a few aliases), through :meth:`EtcdOptions.config`."""
        opts = {k: v for k, v in (options or {}).items() if v not in (None, "")}

        def seconds(name: str, default: timedelta) -> timedelta:
            raw = opts.get(name)
            if raw is None:
                return default
            try:
                return timedelta(seconds=float(raw))
            except ValueError as exc:
                raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}") from exc

        return EtcdOptions(
            endpoints=endpoints,
            ca_cert=opts.get("ca_cert") or opts.get("cacert"),
            cert=opts.get("cert") or opts.get("ssl_cert"),
            cert_key=opts.get("cert_key") or opts.get("ssl_cert_key") or opts.get("key"),
            user=opts.get("user") or opts.get("username"),
            password=opts.get("password"),
            password_file=opts.get("password_file"),
            request_timeout=seconds("request_timeout", REQUEST_TIMEOUT),
            op_timeout=seconds("op_timeout", OP_TIMEOUT),
            connect_timeout=seconds("connect_timeout", CONNECT_TIMEOUT),
        ).config()


def read_password_file(path: str | Path) -> str:
    """The etcd password kept in ``path``, without surrounding white space (the final newline)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the etcd password file {path}: {exc}") from exc


@dataclass(frozen=True)
class EtcdOptions:
    """An etcd connection as named by its user: endpoints ``"h1:2379,h2:2379"``, the TLS files, a user
    with a password (given, or kept in ``password_file``), timeouts. Building it reads nothing; the
    controller, the agents and the workers keep it to hand the same connection on (files, not secrets).
    """

    endpoints: str
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password_file: str | None = None
    password: str | None = None  # given directly (``--rdzv-conf password=``); wins over password_file
    request_timeout: timedelta = REQUEST_TIMEOUT
    op_timeout: timedelta = OP_TIMEOUT
    connect_timeout: timedelta = CONNECT_TIMEOUT

    def config(self) -> EtcdConfig:
        """The connection: endpoints parsed, the password file read, every setting checked (a ValueError
        with one line naming what is wrong)."""
        for name in ("request_timeout", "op_timeout", "connect_timeout"):
            value: timedelta = getattr(self, name)
            if value <= timedelta(0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value.total_seconds():g}")
        password = self.password
        if password is None and self.password_file:
            password = read_password_file(self.password_file)
        return EtcdConfig(
            endpoints=parse_endpoints(self.endpoints),
            ca_cert=self.ca_cert or None,
            cert=self.cert or None,
            cert_key=self.cert_key or None,
            user=self.user or None,
            password=password,
            request_timeout=self.request_timeout,
            op_timeout=self.op_timeout,
            connect_timeout=self.connect_timeout,
        )
