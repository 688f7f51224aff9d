"""free_port: the ports for a local etcd cluster, a controller, a store must never collide."""

from __future__ import annotations

import socket

import pytest

from elastic.testing.etcd_server import free_port

pytestmark = pytest.mark.timeout(30)


def test_free_port_never_hands_out_the_same_port_twice() -> None:
    # Found in CI: in a fresh network namespace two etcd members got the same peer port. With ~28k ephemeral
    # ports, 500 independent probes would repeat one almost surely (birthday bound); the helper must not.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_port_is_bindable_on_the_host_asked_for() -> None:
    port = free_port("127.0.0.2")
    with socket.socket() as s:
        s.bind(("127.0.0.2", port))
