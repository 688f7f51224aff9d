"""What the etcd-v3 handler adds to torch's contract: waits on watches, liveness from leases, a closer that
is taken over when it dies, spares beyond max_nodes, and a constant number of etcd requests per joiner.

Real etcd; members that die are real processes killed with SIGKILL.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.etcd import EtcdClientClosedError, MemoryEtcdServer, create_client
from elastic.etcd.lease import LeaseKeeper
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.plugin import DEFAULT_KEY_PREFIX, create_handler
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules
from elastic.testing.counting_etcd import CountingEtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from tests.elastic.rendezvous.joiners import Joiner, until

pytestmark = pytest.mark.timeout(120)

NODE_TTL = 2


@pytest.fixture
def made() -> Iterator[list[EtcdV3RendezvousHandler]]:
    handlers: list[EtcdV3RendezvousHandler] = []
    yield handlers
    for h in handlers:
        h.release()


def _handler(
    made: list[EtcdV3RendezvousHandler], endpoints: str, run_id: str, addr: str, nodes: tuple[int, int]
) -> EtcdV3RendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3",
        endpoints,
        run_id,
        nodes[0],
        nodes[1],
        local_addr=addr,
        last_call_timeout="1",
        node_ttl=str(NODE_TTL),
    )
    handler = create_handler(params)
    assert isinstance(handler, EtcdV3RendezvousHandler)
    made.append(handler)
    return handler


def _member_process(endpoints: str, run_id: str, addr: str, nodes: tuple[int, int]) -> subprocess.Popen[str]:
    """A handler in a process of its own that joins and then lives until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from elastic.rendezvous.plugin import create_handler
        h = create_handler(RendezvousParameters("etcd-v3", {endpoints!r}, {run_id!r}, {nodes[0]}, {nodes[1]},
                           local_addr={addr!r}, last_call_timeout="1", node_ttl="{NODE_TTL}"))
        print("node", h.node_id, flush=True)
        info = h.next_rendezvous()
        print("joined", info.rank, info.world_size, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.solo  # every rank within 0.5 s: runs alone in a parallel scripts/test.sh (0.58 s once beside the others)
def test_a_full_round_completes_on_the_watch_a_fraction_of_a_second_after_the_last_join(
    etcd_server: LocalEtcdCluster, made: list[EtcdV3RendezvousHandler]
) -> None:
    run = f"w-{uuid.uuid4().hex[:6]}"
    early = [Joiner(_handler(made, etcd_server.endpoints, run, f"127.0.0.{i}", (3, 3))) for i in (1, 2)]
    time.sleep(1.5)  # the two wait for the third (no polling to wait out)
    last = _handler(made, etcd_server.endpoints, run, "127.0.0.3", (3, 3))
    joined_at = time.monotonic()
    joiners = [*early, Joiner(last)]
    assert {j.result().world_size for j in joiners} == {3}
    slowest = max(j.out["done"] for j in joiners) - joined_at
    assert slowest < 0.5, f"all ranks known {slowest:.2f}s after the last join"


def test_a_killed_member_is_noticed_within_its_lease_ttl_and_the_survivor_re_forms_at_once(
    etcd_server: LocalEtcdCluster, made: list[EtcdV3RendezvousHandler]
) -> None:
    run = f"k-{uuid.uuid4().hex[:6]}"
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    client = create_client(etcd_server.config())
    proc = _member_process(etcd_server.endpoints, run, "127.0.0.2", (1, 2))
    try:
        assert proc.stdout is not None
        node = proc.stdout.readline().split()[1]
        until(lambda: client.get(keys.join_key(0, node))[0] is not None, 30, "the other member joining")
        a = _handler(made, etcd_server.endpoints, run, "127.0.0.1", (1, 2))
        assert a.next_rendezvous().world_size == 2
        assert proc.stdout.readline().split()[2] == "2"
        assert a.num_nodes_waiting() == 0
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        noticed = until(lambda: a.num_nodes_waiting() > 0, NODE_TTL + 5, "the survivor noticing the loss")
        info = a.next_rendezvous()
        reformed = time.monotonic() - killed
        assert info.world_size == 1 and info.rank == 0
        assert noticed < NODE_TTL + 1.5, f"lost member noticed after {noticed:.1f}s"
        assert reformed < NODE_TTL + 2, f"re-formed without it after {reformed:.1f}s (no last call waited)"
    finally:
        proc.kill()
        proc.wait()
        client.close()


def test_a_closer_killed_while_its_round_forms_is_taken_over(
    etcd_server: LocalEtcdCluster, made: list[EtcdV3RendezvousHandler]
) -> None:
    run = f"c-{uuid.uuid4().hex[:6]}"
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    client = create_client(etcd_server.config())
    proc = _member_process(etcd_server.endpoints, run, "127.0.0.9", (3, 3))
    try:
        assert proc.stdout is not None
        node = proc.stdout.readline().split()[1]
        until(lambda: client.get(keys.closer(0))[0] is not None, 30, "the first joiner taking the closer's key")
        kv = client.get(keys.closer(0))[0]
        assert kv is not None and kv.value.decode() == node
        proc.send_signal(signal.SIGKILL)
        joiners = [Joiner(_handler(made, etcd_server.endpoints, run, f"127.0.0.{i}", (3, 3))) for i in (1, 2, 3)]
        infos = [j.result(30) for j in joiners]
        assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    finally:
        proc.kill()
        proc.wait()
        client.close()


def test_joiners_beyond_max_nodes_become_spares_that_wait_past_join_timeout_and_get_in_first() -> None:
    # A phantom holds the closer's key while three join a round of at most two; when it goes, one of them
    # closes with the first two to join, and the third waits as a spare without disturbing them, with no
    # time limit (torch's redundancy list), and is first in when a member leaves.
    memory = MemoryEtcdServer()
    client = memory.client()
    run = "spares"
    keys = RendezvousKeys.of("/t", run)
    settings = HandlerSettings(rules=RoundRules(2, 2, timedelta(seconds=1)), join_timeout=timedelta(seconds=1))
    phantom = LeaseKeeper(client, timedelta(seconds=5))
    client.put(keys.closer(0), b"phantom", lease=phantom.lease_id)
    handlers = [
        EtcdV3RendezvousHandler(memory.client(), run, keys, settings, local_addr=f"10.0.0.{i}") for i in range(3)
    ]
    joiners = []
    for h in handlers:
        joiners.append(Joiner(h))
        until(lambda h=h: client.get(keys.join_key(0, h.node_id))[0] is not None, 10, "the join")
    try:
        phantom.close()
        infos = [joiners[i].result(10) for i in (0, 1)]
        assert {i.world_size for i in infos} == {2}
        time.sleep(2.5)  # past join_timeout
        assert joiners[2].thread.is_alive(), "the spare should still wait"
        assert handlers[0].num_nodes_waiting() == handlers[1].num_nodes_waiting() == 0
        assert client.get(keys.join_key(1, handlers[2].node_id))[0] is not None

        again = Joiner(handlers[1])  # a member's workers failed: it re-joins, the other follows
        until(lambda: handlers[0].num_nodes_waiting() > 0, 10, "the member seeing the other leave")
        last = Joiner(handlers[0])
        assert {again.result(10).world_size, joiners[2].result(10).world_size} == {2}
        assert last.thread.is_alive(), "the member that came last is now the spare"
    finally:
        for h in handlers:
            h.release()


def test_a_node_stopped_by_a_signal_leaves_the_rendezvous_open_for_the_others(
    etcd_server: LocalEtcdCluster, made: list[EtcdV3RendezvousHandler]
) -> None:
    # torch 2.6's agent calls shutdown() from its `except SignalException` block, which would close the
    # rendezvous for good: the survivors of a preempted node exited instead of re-forming.
    from torch.distributed.elastic.multiprocessing.api import SignalException

    run = f"s-{uuid.uuid4().hex[:6]}"
    a, b = (_handler(made, etcd_server.endpoints, run, f"127.0.0.{i}", (1, 2)) for i in (1, 2))
    assert {j.result().world_size for j in [Joiner(a), Joiner(b)]} == {2}
    try:
        raise SignalException("got signal: 15", sigval=signal.SIGTERM)
    except SignalException:
        assert b.shutdown()
    assert not a.is_closed()
    until(lambda: a.num_nodes_waiting() > 0, 5, "the survivor seeing the stopped node go")
    assert a.next_rendezvous().world_size == 1
    assert a.shutdown()  # an ordinary shutdown (the job is over) still closes it
    assert a.is_closed()


def test_the_client_the_plugin_made_for_a_handler_is_closed_once_the_handler_is_dropped(
    etcd_server: LocalEtcdCluster,
) -> None:
    # a process that makes and drops handlers (a test run) must not keep their gRPC channels reconnecting
    params = RendezvousParameters(
        "etcd-v3", etcd_server.endpoints, f"d-{uuid.uuid4().hex[:6]}", 1, 1, local_addr="127.0.0.1"
    )
    handler = create_handler(params)
    client = handler._client  # private: the plugin's client, which the handler's lifetime must bound
    assert handler.next_rendezvous().world_size == 1
    assert handler.shutdown()
    assert handler.is_closed()  # still answers after shutdown: the client outlives release()
    del handler
    gc.collect()
    with pytest.raises(EtcdClientClosedError):
        client.ping()


@pytest.mark.parametrize("n", [64])
def test_a_burst_of_joiners_costs_each_a_constant_number_of_etcd_requests(
    etcd_server: LocalEtcdCluster, n: int
) -> None:
    counting = CountingEtcdClient(create_client(etcd_server.config()))
    run = f"b-{uuid.uuid4().hex[:6]}"
    keys = RendezvousKeys.of("/burst", run)
    settings = HandlerSettings(rules=RoundRules(n, n, timedelta(seconds=1)), node_ttl=timedelta(seconds=5))
    handlers = [EtcdV3RendezvousHandler(counting, run, keys, settings, local_addr=f"127.0.1.{i}") for i in range(n)]
    try:
        for h in handlers:
            h.register()  # the agents start (a lease and an alive key each), then join at once
        counting.reset()
        started = time.monotonic()
        joiners = [Joiner(h) for h in handlers]
        infos = [j.result(60) for j in joiners]
        elapsed = time.monotonic() - started
        counts = counting.snapshot()
        assert sorted(i.rank for i in infos) == list(range(n))
        # The protocol's requests (transactions and watches); the round's store traffic (torch's
        # RendezvousStoreInfo: rank 0 publishes its address, the others read it) is counted apart.
        protocol = counts.get("txn", 0) + counts.get("watch_revisions", 0)
        # per joiner: the join, the read of the assignment (two for one woken by the closer's key) and a
        # successor watch; the rounds watch is shared by the process; the closer's few reads come on top
        assert protocol / n <= 5, f"{protocol / n:.1f} etcd requests per joiner ({counts})"
        assert elapsed < 20, f"{n} joiners took {elapsed:.1f}s"
    finally:
        for h in handlers:
            h.release()
        counting.inner.close()


def test_spares_of_a_full_running_round_do_not_form_a_round_of_their_own() -> None:
    # min_nodes=1: a lone spare reaches min_nodes, yet must wait while the full round runs (torch's
    # redundancy list), instead of forming a round that would make the running one re-form, every round.
    memory = MemoryEtcdServer()
    keys = RendezvousKeys.of("/t", "lone-spare")
    settings = HandlerSettings(rules=RoundRules(1, 2, timedelta(seconds=0.5)))
    a, b, c = (
        EtcdV3RendezvousHandler(memory.client(), "lone-spare", keys, settings, local_addr=f"10.0.1.{i}")
        for i in range(3)
    )
    try:
        assert {j.result(10).world_size for j in [Joiner(a), Joiner(b)]} == {2}
        rounds = (a.round, b.round)
        spare = Joiner(c)
        time.sleep(3)  # several last calls
        assert spare.thread.is_alive(), "the spare formed a round of its own"
        assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
        assert (a.round, b.round) == rounds

        b.release()  # a member dies: the survivor and the spare form the next round
        until(lambda: a.num_nodes_waiting() > 0, 10, "the survivor seeing the loss")
        assert a.next_rendezvous().world_size == 2
        assert spare.result(10).world_size == 2
    finally:
        for h in (a, b, c):
            h.release()


def test_a_node_whose_lease_lapsed_before_it_joins_joins_on_a_new_one() -> None:
    # etcd overloaded or out of reach for node_ttl: the lease is gone when the join transaction attaches to it.
    memory = MemoryEtcdServer()
    client = memory.client()
    keys = RendezvousKeys.of("/t", "lapsed")
    h = EtcdV3RendezvousHandler(client, "lapsed", keys, HandlerSettings(rules=RoundRules(1, 1, timedelta(seconds=1))))
    try:
        h.register()
        (alive,) = client.get_prefix(keys.alive)[0]
        client.revoke_lease(alive.lease)
        assert h.next_rendezvous().world_size == 1
        kv = client.get(keys.join_key(0, h.node_id))[0]
        assert kv is not None and kv.lease not in (0, alive.lease)
        assert client.get(keys.alive_key(h.node_id))[0] is not None  # announced again on the new lease
    finally:
        h.release()
