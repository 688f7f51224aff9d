"""Leader election on the in-memory etcd: campaign, fencing tokens, loss of the lease (no etcd needed).

Each replica has its own client of one :class:`MemoryEtcdServer`; lease time runs on a :class:`ManualClock`,
so a lease expires exactly when a test moves the clock, and a partition is a client cut off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import ManualClock, MemoryEtcdClient, MemoryEtcdServer
from service.controller.leader import LeaderElection, create_election
from service.core.models import JobRecord, JobSpec, JobStatus
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import JobUpdate

pytestmark = pytest.mark.timeout(30)

TTL = timedelta(seconds=1)
KEY = "/t/leader"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> MemoryEtcdServer:
    return MemoryEtcdServer(clock)


@pytest.fixture
def replicas(server: MemoryEtcdServer) -> Iterator[tuple[LeaderElection, LeaderElection]]:
    a = create_election(server.client(), KEY, "replica-a", TTL)
    b = create_election(server.client(), KEY, "replica-b", TTL)
    yield a, b
    for r in (a, b):
        r._client.set_reachable(True)  # type: ignore[attr-defined]
        r.resign()


def _client(replica: LeaderElection) -> MemoryEtcdClient:
    client = replica._client
    assert isinstance(client, MemoryEtcdClient)
    return client


def test_the_first_campaign_wins_with_the_leader_keys_create_revision_as_fence(
    replicas: tuple[LeaderElection, LeaderElection],
) -> None:
    a, _ = replicas
    assert a.fence is None and not a.is_leader
    assert a.campaign() is True
    kv, _ = _client(a).get(KEY)
    assert kv is not None and a.fence == (KEY, kv.create_revision) and kv.lease != 0


def test_campaign_is_idempotent_for_the_leader(replicas: tuple[LeaderElection, LeaderElection]) -> None:
    a, _ = replicas
    a.campaign()
    fence = a.fence
    assert a.campaign() is True and a.fence == fence


def test_a_second_replica_loses_while_the_leader_lives_and_sees_who_leads(
    replicas: tuple[LeaderElection, LeaderElection],
) -> None:
    a, b = replicas
    assert a.campaign() is True
    assert b.campaign() is False and b.fence is None
    assert (b.leader() or {}).get("replica") == "replica-a"


def test_resign_hands_over_and_voids_the_old_fence(replicas: tuple[LeaderElection, LeaderElection]) -> None:
    a, b = replicas
    a.campaign()
    old = a.fence
    assert old is not None
    a.resign()
    assert a.fence is None and _client(a).get(KEY)[0] is None  # revoking the lease deleted the key
    assert b.campaign() is True and b.fence != old
    assert _client(b).commit([("/t/x", b"a")], guard=old)[0] is False
    assert _client(b).commit([("/t/x", b"b")], guard=b.fence)[0] is True


def test_a_partitioned_leader_is_replaced_when_its_lease_expires_and_cannot_write_before_it_notices(
    replicas: tuple[LeaderElection, LeaderElection], clock: ManualClock
) -> None:
    a, b = replicas
    store = ServiceStore(_client(b), "/t")
    now = datetime.now(timezone.utc)
    record = JobRecord(id="j-1", spec=JobSpec(name="j", entrypoint="t.py"), created_at=now)
    store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "x", now))
    assert a.campaign() is True
    stale = a.fence
    assert stale is not None
    _client(a).set_reachable(False)  # a's keep-alives fail from now on
    assert (b.leader() or {}).get("replica") == "replica-a"  # the lease has not run out yet
    clock.advance(TTL.total_seconds())
    assert b.campaign() is True
    entry = store.get_job("j-1")
    assert entry is not None
    update = JobUpdate("j-1", entry.status_revision, entry.status.model_copy(update={"state": JobState.FAILED}))
    assert store.apply(update, stale) is False  # a still believes it leads; its writes are void
    _client(a).set_reachable(True)
    assert a.campaign() is False and not a.is_leader
    assert (a.leader() or {}).get("replica") == "replica-b"


def test_a_leader_whose_lease_was_lost_and_regranted_wins_again_only_with_a_new_fence(
    replicas: tuple[LeaderElection, LeaderElection], server: MemoryEtcdServer, clock: ManualClock
) -> None:
    a, _ = replicas
    a.campaign()
    old = a.fence
    assert old is not None
    (lease,) = server.lease_ids()
    _client(a).set_reachable(False)
    clock.advance(TTL.total_seconds())
    assert server.lease_ids() == []
    _client(a).set_reachable(True)
    deadline = time.monotonic() + 10
    while server.lease_ids() in ([], [lease]):  # the keeper finds its lease gone and grants a new one
        assert time.monotonic() < deadline, "the lease keeper did not re-grant"
        time.sleep(0.05)
    assert a.campaign() is True
    assert a.fence is not None and a.fence != old


def test_leader_is_none_without_one_and_the_raw_value_when_it_is_not_json(
    replicas: tuple[LeaderElection, LeaderElection],
) -> None:
    a, _ = replicas
    assert a.leader() is None
    _client(a).put(KEY, b"someone")
    assert a.leader() == {"replica": "someone"}


def test_wait_for_change_returns_at_once_without_a_leader_and_wakes_when_the_leader_resigns(
    replicas: tuple[LeaderElection, LeaderElection],
) -> None:
    a, b = replicas
    started = time.monotonic()
    b.wait_for_change(timedelta(seconds=10))
    assert time.monotonic() - started < 1
    a.campaign()
    threading.Timer(0.2, a.resign).start()
    started = time.monotonic()
    b.wait_for_change(timedelta(seconds=10))
    assert time.monotonic() - started < 5
    assert b.campaign() is True
