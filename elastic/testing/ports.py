"""Free ports for the local servers of tests, demos and benches (etcd members, controllers, stores, S3).

By default the kernel picks them (a probe socket bound to port 0). With ``ETRAIN_PORT_RANGE=LOW-HIGH`` they
come from that range instead, which is how parallel test processes stay out of each other's way: each
pytest-xdist worker gets a range of its own (``tests/conftest.py``) below the kernel's ephemeral range, so a
port one worker has probed but not yet bound is never offered to another, nor to an outgoing connection.
"""

from __future__ import annotations

import os
import random
import socket

from elastic.contract import env as contract

__all__ = ["PORT_RANGE_ENV", "free_port", "port_range"]

PORT_RANGE_ENV = contract.PORT_RANGE

_handed_out: set[tuple[str, int]] = set()


def port_range() -> tuple[int, int] | None:
    """``(low, high)`` (inclusive) from ``$ETRAIN_PORT_RANGE``, or None when unset or malformed."""
    low, sep, high = os.environ.get(PORT_RANGE_ENV, "").partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        return None
    lo, hi = int(low), int(high)
    return (lo, hi) if 0 < lo <= hi < 65536 else None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, never one this process handed out before: the kernel may offer the same
    ephemeral port to consecutive binds once the probe socket is closed (seen in a fresh network namespace,
    where an etcd cluster then got the same peer port twice). Within ``$ETRAIN_PORT_RANGE`` when that is set
    (from a random place in it; the kernel's choice once every port there was handed out)."""
    bounds = port_range()
    if bounds is not None:
        lo, hi = bounds
        size = hi - lo + 1
        start = random.randrange(size)
        for i in range(size):
            port = lo + (start + i) % size
            if (host, port) not in _handed_out and _bindable(host, port):
                _handed_out.add((host, port))
                return port
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if (host, port) not in _handed_out:
            _handed_out.add((host, port))
            return port
    raise RuntimeError(f"no fresh free port on {host}")
