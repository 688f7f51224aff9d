"""What only the in-memory etcd model has: its clock, shared servers, cut-off clients (no etcd needed)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from elastic.etcd import EtcdClient, EtcdConnectionError, ManualClock, MemoryEtcdClient, MemoryEtcdServer
from elastic.etcd.memory import TICK

pytestmark = pytest.mark.timeout(30)


def test_a_memory_client_is_an_etcd_client_of_a_fresh_cluster_at_revision_one() -> None:
    client = MemoryEtcdClient()
    assert isinstance(client, EtcdClient)
    assert client.ping() == 1
    assert client.endpoints_label == "memory://memory"


def test_clients_of_one_server_share_state_and_separate_servers_do_not() -> None:
    server = MemoryEtcdServer()
    a, b = server.client(), server.client()
    a.put("/k", b"v")
    assert b.get("/k")[0] is not None
    assert MemoryEtcdServer().client().get("/k")[0] is None


def test_a_manual_clock_moves_only_forward_when_advanced() -> None:
    clock = ManualClock(5.0)
    assert clock() == 5.0
    clock.advance(1.5)
    assert clock() == 6.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_a_lease_expires_exactly_when_the_clock_passes_its_ttl() -> None:
    clock = ManualClock()
    server = MemoryEtcdServer(clock)
    client = server.client()
    lease = client.grant_lease(timedelta(seconds=3))
    client.put("/k", b"v", lease=lease)
    clock.advance(2.9)
    assert client.get("/k")[0] is not None and server.lease_ids() == [lease]
    clock.advance(0.1)
    assert client.get("/k")[0] is None and server.lease_ids() == []


def test_min_lease_ttl_raises_short_leases_like_a_real_cluster() -> None:
    client = MemoryEtcdServer(ManualClock(), min_lease_ttl=2).client()
    lease = client.grant_lease(timedelta(seconds=1))
    assert client.keep_alive_once(lease) == 2


def test_a_cut_off_client_fails_at_once_while_others_keep_working() -> None:
    server = MemoryEtcdServer()
    cut, other = server.client(), server.client()
    cut.set_reachable(False)
    started = time.monotonic()
    with pytest.raises(EtcdConnectionError, match="memory://"):
        cut.put("/k", b"v")
    with pytest.raises(EtcdConnectionError):
        cut.keep_alive_once(1)
    assert time.monotonic() - started < 1
    other.put("/k", b"v")
    cut.set_reachable(True)
    assert cut.get("/k")[0] is not None


def test_a_cut_off_clients_lease_expires_because_it_cannot_keep_it_alive() -> None:
    clock = ManualClock()
    server = MemoryEtcdServer(clock)
    cut, other = server.client(), server.client()
    lease = cut.grant_lease(timedelta(seconds=2))
    cut.put("/leader", b"me", lease=lease)
    cut.set_reachable(False)
    clock.advance(2)
    assert other.get("/leader")[0] is None
    cut.set_reachable(True)
    assert cut.keep_alive_once(lease) == 0


def test_a_cut_off_client_waits_out_its_timeout_and_sees_changes_once_reconnected() -> None:
    server = MemoryEtcdServer()
    cut, other = server.client(), server.client()
    start = other.put("/k", b"1")
    cut.set_reachable(False)
    assert cut.wait_for_event("/k", start, timedelta(seconds=0.2)) is False
    threading.Timer(0.2, cut.set_reachable, args=(True,)).start()
    assert cut.wait_for_event("/k", start, timedelta(seconds=10)) is True


def test_a_watch_notices_a_clock_driven_expiry_within_a_tick() -> None:
    clock = ManualClock()
    server = MemoryEtcdServer(clock)
    client = server.client()
    lease = client.grant_lease(timedelta(seconds=1))
    revision = client.put("/k", b"v", lease=lease)
    threading.Timer(0.1, clock.advance, args=(1,)).start()
    started = time.monotonic()
    assert client.wait_for_event("/k", revision + 1, timedelta(seconds=10)) is True
    assert time.monotonic() - started < 0.1 + 10 * TICK
