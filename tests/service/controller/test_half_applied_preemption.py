"""A preemption is never half applied (real controller passes on a real etcd): when the victim's update is not
applied, the beneficiary's assignment to the victim's node is held back, so no node is ever booked by two jobs; and a
victim cannot make its own status too large to write (and so its release impossible) through huge ``nodes`` lists in
its progress reports."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.controller.reconcile import reconcile
from service.core.models import JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.store import ServiceStore, new_event
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(120)

LOW, HIGH = "low-00000001", "high-00000002"


@pytest.fixture
def store(etcd_client: EtcdClient, key_prefix: str) -> Iterator[ServiceStore]:
    store = ServiceStore(etcd_client, key_prefix)
    lease = etcd_client.grant_lease(timedelta(seconds=120))
    store.register_node(
        NodeInfo(name="n1", capacity=1, incarnation="x", registered_at=datetime.now(timezone.utc)), lease
    )
    yield store
    etcd_client.revoke_lease(lease)


def _submit(store: ServiceStore, job_id: str, priority: int) -> None:
    now = datetime.now(timezone.utc)
    spec = JobSpec(name=job_id.split("-")[0], entrypoint="t.py", priority=priority)
    record = JobRecord(id=job_id, spec=spec, created_at=now, checkpoint_url=f"file:///ck/{job_id}")
    store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "test", now))


def _status(store: ServiceStore, job_id: str) -> JobStatus:
    entry = store.get_job(job_id)
    assert entry is not None
    return entry.status


def _booked(store: ServiceStore) -> list[str]:
    """The active jobs assigned to node n1."""
    _, assigned = store.list_nodes()
    return sorted(j for j in assigned.get("n1", []) if not _status(store, j).state.terminal)


def test_a_refused_release_holds_the_beneficiary_back(
    etcd_server: LocalEtcdCluster, key_prefix: str, store: ServiceStore
) -> None:
    settings = make_settings(etcd_server, key_prefix)
    controller = Controller(store, settings)
    try:
        _submit(store, LOW, 0)
        controller.tick()
        assert _booked(store) == [LOW]
        _submit(store, HIGH, 10)
        plan = reconcile(store.read_view(), datetime.now(timezone.utc), settings.reconcile)
        high = next(u for u in plan.updates if u.job_id == HIGH)
        assert "n1" in high.assign  # the preemption: LOW gives n1 up, HIGH takes it
        # LOW's status changes before the plan is applied: its update (the release) is refused as stale
        kv, _ = store.client.get(store.keys.status_of(LOW))
        assert kv is not None
        store.client.put(kv.key, kv.value)
        fence = controller.election.fence
        assert fence is not None
        outcome = store.apply_plan(plan, fence)
        assert _booked(store) == [LOW]  # not [HIGH, LOW]: n1 is not booked twice
        assert high.after == [LOW] and outcome.held == (HIGH,) and outcome.refused == 2
        for _ in range(3):  # the next passes decide again: the preemption goes through whole
            controller.tick()
            assert len(_booked(store)) <= 1
        assert _booked(store) == [HIGH] and _status(store, LOW).nodes == []  # preempted: waits for nodes
    finally:
        controller.stop()


def test_huge_node_lists_in_progress_cannot_make_a_victims_release_fail(
    etcd_server: LocalEtcdCluster, key_prefix: str, store: ServiceStore
) -> None:
    controller = Controller(store, make_settings(etcd_server, key_prefix))
    try:
        _submit(store, LOW, 0)
        controller.tick()
        names = [f"n{i:04d}-" + "x" * 56 for i in range(2900)]  # valid names, ~190 KB per report
        for n in range(1, 11):  # each report a new world size: an entry of the status's world-size history
            progress = Progress(
                step=n,
                world_size=1 + n % 2,
                time=datetime.now(timezone.utc).timestamp() + n,
                generation=_status(store, LOW).generation,
                nodes=names,
            )
            store.client.put(store.keys.progress_of(LOW), progress.to_json())
            controller.tick()
            assert len(_booked(store)) <= 1
        status = _status(store, LOW)
        assert status.step == 10 and all(len(c.nodes) <= 60 for c in status.world_size_history)
        kv, _ = store.client.get(store.keys.status_of(LOW))
        assert kv is not None and len(kv.value) < 256 * 1024
        _submit(store, HIGH, 10)
        for _ in range(3):
            controller.tick()
            assert len(_booked(store)) <= 1, _booked(store)  # never both jobs on n1
        assert _booked(store) == [HIGH] and _status(store, LOW).nodes == []  # preempted: waits for nodes
    finally:
        controller.stop()
