"""Connection settings for an etcd v3 cluster, parsed from endpoint strings and key/value options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["EtcdConfig", "parse_endpoints"]

_DEFAULT_PORT = 2379


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
    request_timeout: timedelta = timedelta(seconds=5)
    op_timeout: timedelta = timedelta(seconds=30)
    connect_timeout: timedelta = timedelta(seconds=5)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.cert_key is None):
            raise ValueError("etcd TLS: cert and cert_key must be given together")
        if self.cert is not None and self.ca_cert is None:
            raise ValueError("etcd TLS: a client certificate needs ca_cert as well")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth: user and password must be given together")

    @classmethod
    def from_options(cls, endpoints: str, options: Mapping[str, str | None] | None = None) -> EtcdConfig:
        """Build from an endpoint list and string options (``ca_cert``, ``cert``, ``cert_key``, ``user``,
        ``password``, ``request_timeout``, ``op_timeout``, ``connect_timeout`` in seconds)."""
        opts = {k: v for k, v in (options or {}).items() if v not in (None, "")}

        def seconds(name: str, default: float) -> timedelta:
            raw = opts.get(name)
            if raw is None:
                return timedelta(seconds=default)
            value = float(raw)
            if value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
            return timedelta(seconds=value)

        return cls(
            endpoints=parse_endpoints(endpoints),
            ca_cert=opts.get("ca_cert") or opts.get("cacert"),
            cert=opts.get("cert") or opts.get("ssl_cert"),
            cert_key=opts.get("cert_key") or opts.get("ssl_cert_key") or opts.get("key"),
            user=opts.get("user") or opts.get("username"),
            password=opts.get("password"),
            request_timeout=seconds("request_timeout", 5),
            op_timeout=seconds("op_timeout", 30),
            connect_timeout=seconds("connect_timeout", 5),
        )
