"""The etcd-v3 handler's two departures from torch's polling handler engage on the installed torch.

Both rest on torch's private API (``elastic/compat.py``): if a torch release stopped calling
``dynamic_rendezvous._delay`` or changed the state layout, the rendezvous would still work, only slowly,
by torch's polling and heartbeat timeouts. These tests fail in that case. Real etcd, real torch handlers
(in threads of one process, told apart by their loopback addresses).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic import compat
from elastic.rendezvous.plugin import EtcdV3RendezvousHandler, create_handler
from elastic.testing.etcd_server import LocalEtcdCluster

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def handlers(etcd_server: LocalEtcdCluster) -> Iterator[list[EtcdV3RendezvousHandler]]:
    made: list[EtcdV3RendezvousHandler] = []
    yield made
    for h in made:
        h._etcd_backend.close()


def _handler(
    made: list[EtcdV3RendezvousHandler], endpoints: str, run_id: str, addr: str, nodes: tuple[int, int]
) -> EtcdV3RendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3", endpoints, run_id, nodes[0], nodes[1], local_addr=addr, last_call_timeout="1", node_ttl="2"
    )
    handler = create_handler(params)
    assert isinstance(handler, EtcdV3RendezvousHandler)
    made.append(handler)
    return handler


def _rendezvous_in_thread(handler: EtcdV3RendezvousHandler, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        out["info"] = handler.next_rendezvous()
        out["done"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _world_size(info: Any) -> int:
    return int(info.world_size)


def _round_of_two(
    made: list[EtcdV3RendezvousHandler], endpoints: str, run_id: str
) -> tuple[EtcdV3RendezvousHandler, EtcdV3RendezvousHandler]:
    """Two handlers (min 1, max 2) that have completed a round together."""
    a = _handler(made, endpoints, run_id, "127.0.0.1", (1, 2))
    b = _handler(made, endpoints, run_id, "127.0.0.2", (1, 2))
    out_a: dict[str, Any] = {}
    for t in (_rendezvous_in_thread(a, out_a), _rendezvous_in_thread(b, {})):
        t.join(30)
    assert _world_size(out_a["info"]) == 2
    return a, b


def test_a_waiting_node_is_woken_by_the_etcd_watch_not_by_torchs_one_second_poll(
    etcd_server: LocalEtcdCluster, handlers: list[EtcdV3RendezvousHandler]
) -> None:
    run_id = f"watch-{uuid.uuid4().hex[:6]}"
    a = _handler(handlers, etcd_server.endpoints, run_id, "127.0.0.1", (2, 2))
    b = _handler(handlers, etcd_server.endpoints, run_id, "127.0.0.2", (2, 2))
    woken: list[bool] = []
    wait = a._etcd_backend.wait_for_change

    def counting(timeout: timedelta) -> bool:
        changed = wait(timeout)
        woken.append(changed)
        return changed

    a._etcd_backend.wait_for_change = counting  # type: ignore[method-assign]
    out_a: dict[str, Any] = {}
    ta = _rendezvous_in_thread(a, out_a)
    time.sleep(1.5)  # a waits for b: torch's executor calls _delay, which must reach the watch
    out_b: dict[str, Any] = {}
    tb = _rendezvous_in_thread(b, out_b)
    ta.join(30)
    tb.join(30)
    assert _world_size(out_a["info"]) == _world_size(out_b["info"]) == 2
    assert woken, "torch never called dynamic_rendezvous._delay while a node waited: the watch wait is off"
    assert True in woken, "no wait returned on an etcd change"


def test_a_member_whose_lease_is_gone_is_dropped_at_once_not_after_torchs_heartbeat_timeout(
    etcd_server: LocalEtcdCluster, handlers: list[EtcdV3RendezvousHandler]
) -> None:
    a, b = _round_of_two(handlers, etcd_server.endpoints, f"lease-{uuid.uuid4().hex[:6]}")
    b_node = compat.handler_node(b)
    assert b_node in compat.handler_state(a).participants

    lost_at = time.monotonic()
    b._etcd_backend.close()  # b's liveness key goes with its lease, as when its agent dies
    deadline = lost_at + 10
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the survivor never noticed the lost member"
        time.sleep(0.1)
    noticed = time.monotonic() - lost_at

    out: dict[str, Any] = {}
    _rendezvous_in_thread(a, out).join(30)
    reformed = out["done"] - lost_at
    assert _world_size(out["info"]) == 1
    assert b_node not in compat.handler_state(a).participants
    # torch alone: 5 s x 3 missed heartbeats before b is dropped, then the last call.
    assert noticed < 5, f"lost member noticed after {noticed:.1f}s"
    assert reformed < 8, f"re-formed without it after {reformed:.1f}s"


def test_a_node_stopped_by_a_signal_leaves_the_rendezvous_open_for_the_others(
    etcd_server: LocalEtcdCluster, handlers: list[EtcdV3RendezvousHandler]
) -> None:
    # torch 2.6's agent calls shutdown() from its `except SignalException` block, which would close the
    # rendezvous for good: the survivors of a preempted node exited instead of re-forming.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    a, b = _round_of_two(handlers, etcd_server.endpoints, f"signal-{uuid.uuid4().hex[:6]}")
    try:
        raise SignalException("got signal: 15", sigval=signal.SIGTERM)
    except SignalException:
        assert b.shutdown()
    assert not a.is_closed()
    out: dict[str, Any] = {}
    _rendezvous_in_thread(a, out).join(30)
    assert _world_size(out["info"]) == 1

    assert a.shutdown()  # an ordinary shutdown (the job is over) still closes it
    assert a.is_closed()
