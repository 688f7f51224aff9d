"""torchrun's ``RendezvousHandler`` contract, run against the etcd-v3 handler (on a real etcd and on the
in-memory model) and against torch's own c10d dynamic rendezvous (the reference).

Running torch's handler through the same suite shows the contract is torch's, not ours. Handlers run in
threads of one process, told apart by their loopback addresses.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from elastic.etcd import MemoryEtcdServer
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.plugin import create_handler
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules
from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from tests.elastic.rendezvous.joiners import Joiner, until

pytestmark = pytest.mark.timeout(120)

#: make(run_id, min_nodes, max_nodes, addr, join_timeout seconds) -> a handler
Make = Callable[[str, int, int, str, float], RendezvousHandler]
LAST_CALL = 1


@pytest.fixture(autouse=True)
def _unshared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # what the etcd-v3 plugin sets for torchrun


@pytest.fixture(params=["etcd-v3", "etcd-v3-memory", "c10d-reference"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    made: list[RendezvousHandler] = []
    kind = request.param
    if kind == "etcd-v3":
        server: LocalEtcdCluster = request.getfixturevalue("etcd_server")

        def factory(run_id: str, lo: int, hi: int, addr: str, join: float) -> RendezvousHandler:
            params = RendezvousParameters(
                "etcd-v3",
                server.endpoints,
                run_id,
                lo,
                hi,
                local_addr=addr,
                last_call_timeout=str(LAST_CALL),
                node_ttl="2",
                join_timeout=str(join),
            )
            return create_handler(params)

    elif kind == "etcd-v3-memory":
        memory = MemoryEtcdServer()

        def factory(run_id: str, lo: int, hi: int, addr: str, join: float) -> RendezvousHandler:
            settings = HandlerSettings(
                rules=RoundRules(lo, hi, timedelta(seconds=LAST_CALL)), join_timeout=timedelta(seconds=join)
            )
            h = EtcdV3RendezvousHandler(
                memory.client(), run_id, RendezvousKeys.of("/contract", run_id), settings, local_addr=addr
            )
            h.register()
            return h

    else:
        store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)

        def factory(run_id: str, lo: int, hi: int, addr: str, join: float) -> RendezvousHandler:
            client = TCPStore("127.0.0.1", store.port, is_master=False)
            backend = C10dRendezvousBackend(client, run_id)
            timeout = RendezvousTimeout(join=timedelta(seconds=join), last_call=timedelta(seconds=LAST_CALL))
            return DynamicRendezvousHandler.from_backend(run_id, client, backend, lo, hi, addr, timeout)

    def tracked(run_id: str, lo: int, hi: int, addr: str, join: float = 60) -> RendezvousHandler:
        h = factory(run_id, lo, hi, addr, join)
        made.append(h)
        return h

    yield tracked
    for h in made:
        if isinstance(h, EtcdV3RendezvousHandler):
            h.release()


def _run_id() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def _form(handlers: list[RendezvousHandler]) -> list[Any]:
    joiners = [Joiner(h) for h in handlers]
    return [j.result() for j in joiners]


def test_nodes_up_to_max_form_one_world_with_distinct_ranks_and_one_master(make: Make) -> None:
    run = _run_id()
    infos = _form([make(run, 3, 3, f"127.0.0.{i + 1}") for i in range(3)])
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(masters) == 1
    # the round's store is shared: what one rank sets, another reads
    infos[0].store.set("contract/key", b"v")
    assert infos[2].store.get("contract/key") == b"v"


def test_a_round_completes_at_min_nodes_after_last_call_and_a_late_node_is_let_in(make: Make) -> None:
    run = _run_id()
    a, b = make(run, 2, 3, "127.0.0.1"), make(run, 2, 3, "127.0.0.2")
    started = time.monotonic()
    assert [i.world_size for i in _form([a, b])] == [2, 2]
    assert time.monotonic() - started >= LAST_CALL * 0.9  # waited the last call for a third node

    late = Joiner(make(run, 2, 3, "127.0.0.3"))
    until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 15, "the members seeing the late node")
    infos = [*_form([a, b]), late.result()]
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}


def test_a_member_that_rejoins_makes_the_others_re_form(make: Make) -> None:
    run = _run_id()
    a, b = make(run, 2, 2, "127.0.0.1"), make(run, 2, 2, "127.0.0.2")
    _form([a, b])
    assert a.num_nodes_waiting() == 0
    again = Joiner(b)  # b's workers failed: its agent re-rendezvouses
    until(lambda: a.num_nodes_waiting() > 0, 15, "the member seeing the other rejoin")
    assert {_form([a])[0].world_size, again.result().world_size} == {2}


def test_a_spare_beyond_max_nodes_is_not_counted_as_waiting(make: Make) -> None:
    run = _run_id()
    a, b = make(run, 2, 2, "127.0.0.1"), make(run, 2, 2, "127.0.0.2")
    _form([a, b])
    spare = Joiner(make(run, 2, 2, "127.0.0.3"))
    time.sleep(2.5)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    assert spare.thread.is_alive()  # still waiting for room


def test_closing_fails_waiting_and_later_joins_and_is_seen_by_all(make: Make) -> None:
    run = _run_id()
    waiting = Joiner(make(run, 2, 2, "127.0.0.1"))
    time.sleep(0.5)
    other = make(run, 2, 2, "127.0.0.2")
    assert not other.is_closed()
    other.set_closed()
    with pytest.raises(RendezvousClosedError):
        waiting.result(30)
    assert other.is_closed()
    with pytest.raises(RendezvousClosedError):
        make(run, 1, 2, "127.0.0.3").next_rendezvous()


def test_a_round_that_cannot_complete_times_out(make: Make) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        make(_run_id(), 2, 2, "127.0.0.1", 2).next_rendezvous()
    assert time.monotonic() - started < 15


def test_runs_are_isolated(make: Make) -> None:
    one, two = _run_id(), _run_id()
    infos = _form([make(one, 1, 1, "127.0.0.1"), make(two, 1, 1, "127.0.0.2")])
    assert [(i.rank, i.world_size) for i in infos] == [(0, 1), (0, 1)]
