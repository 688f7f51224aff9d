"""Leader election by lease + fencing on a real etcd: one leader at a time, a deposed leader cannot write."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.leader import LeaderElection
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import JobUpdate
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(60)
TTL = timedelta(seconds=2)


def test_only_one_replica_leads_and_the_other_takes_over_on_resign(etcd_client: EtcdClient, key_prefix: str) -> None:
    a = LeaderElection(etcd_client, key_prefix + "/leader", "replica-a", TTL)
    b = LeaderElection(etcd_client, key_prefix + "/leader", "replica-b", TTL)
    try:
        assert a.campaign() is True
        assert a.campaign() is True  # idempotent
        assert b.campaign() is False
        assert a.is_leader and not b.is_leader and b.fence is None
        assert (b.leader() or {}).get("replica") == "replica-a"
        old_fence = a.fence
        assert old_fence is not None
        a.resign()
        assert b.campaign() is True
        ok, _ = etcd_client.commit([(key_prefix + "/x", b"from-a")], guard=old_fence)
        assert not ok  # the old leader's token is void
        ok, _ = etcd_client.commit([(key_prefix + "/x", b"from-b")], guard=b.fence)
        assert ok
    finally:
        a.resign()
        b.resign()


def test_deposed_leader_cannot_write_even_before_it_notices(etcd_client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "/leader"
    a = LeaderElection(etcd_client, key, "replica-a", TTL)
    b = LeaderElection(etcd_client, key, "replica-b", TTL)
    store = ServiceStore(etcd_client, key_prefix)
    now = datetime.now(timezone.utc)
    record = JobRecord(id="j-1", spec=JobSpec(name="j", entrypoint="t.py"), created_at=now)
    store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "x", now))
    try:
        assert a.campaign()
        stale = a.fence
        assert stale is not None
        etcd_client.delete(key)  # what the expiry of a's lease does (a paused, partitioned, ...)
        assert b.campaign()
        entry = store.get_job("j-1")
        assert entry is not None
        update = JobUpdate(
            job_id="j-1",
            expected_revision=entry.status_revision,
            status=entry.status.model_copy(update={"state": JobState.FAILED, "message": "from deposed a"}),
        )
        assert store.apply(update, stale) is False
        assert store.get_job("j-1").status.state == JobState.PENDING  # type: ignore[union-attr]
        assert a.campaign() is False and not a.is_leader  # and a learns it on its next campaign
        fence_b = b.fence
        assert fence_b is not None and store.apply(update, fence_b) is True
        assert store.get_job("j-1").status.message == "from deposed a"  # type: ignore[union-attr]
    finally:
        a.resign()
        b.resign()


def test_two_controller_replicas_reconcile_one_at_a_time(etcd_server: LocalEtcdCluster, key_prefix: str) -> None:
    from elastic.etcd import create_client

    clients = [create_client(etcd_server.config(op_timeout=5)) for _ in range(2)]
    replicas = [
        Controller(ServiceStore(c, key_prefix), make_settings(etcd_server, key_prefix, replica_id=f"r{i}"))
        for i, c in enumerate(clients)
    ]
    try:
        revisions = [r.tick() for r in replicas]
        assert revisions[0] is not None and revisions[1] is None
        replicas[0].stop(resign=True)
        assert replicas[1].tick() is not None
        assert (replicas[0].election.leader() or {}).get("replica") == "r1"
    finally:
        for r in replicas:
            r.stop()
        for c in clients:
            c.close()
