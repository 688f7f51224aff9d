"""The scheduling metrics: queue length, nodes per job, nodes by mode (read from etcd at scrape time), restarts by
cause, and the leader's count of the scheduling actions it applied (in-memory etcd)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import MemoryEtcdClient, MemoryEtcdServer
from service.controller import loop
from service.controller.loop import Controller
from service.controller.metrics import Metrics, create_metrics
from service.core.config import EtcdOptions, Settings
from service.core.models import Event, JobRecord, JobSpec, JobStatus, NodeControl, NodeInfo, NodeMode, Restarts
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import ClusterView, JobUpdate, Plan, ReconcileConfig

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def client() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.fixture
def store(client: MemoryEtcdClient) -> ServiceStore:
    return ServiceStore(client, "/etrain")


@pytest.fixture
def metrics(store: ServiceStore) -> Iterator[Metrics]:
    m = create_metrics(store)
    yield m
    m.close()


def _job(store: ServiceStore, job_id: str, state: JobState, nodes: list[str], restarts: Restarts | None = None) -> None:
    record = JobRecord(id=job_id, spec=JobSpec(name="job", entrypoint="t.py", max_nodes=4), created_at=T0)
    status = JobStatus(state=state, nodes=nodes, restarts=restarts or Restarts(), created_at=T0, updated_at=T0)
    store.create_job(record, status, new_event("submitted", "submitted", T0))


def _node(store: ServiceStore, name: str) -> None:
    lease = store.client.grant_lease(timedelta(seconds=300))  # as an agent registers: a record on none is no node
    store.register_node(NodeInfo(name=name, capacity=1, incarnation="i", registered_at=T0), lease)


def _control(store: ServiceStore, name: str, mode: NodeMode) -> None:
    store.set_node_control(NodeControl(name=name, mode=mode, at=T0, requested_by="op"))


def test_queue_length_nodes_per_job_and_nodes_by_mode_are_read_from_etcd(store: ServiceStore, metrics: Metrics) -> None:
    _job(store, "a", JobState.PENDING, [])
    _job(store, "b", JobState.RECOVERING, [])  # waiting for nodes again: queued
    _job(store, "c", JobState.RUNNING, ["n1", "n2"], Restarts(planned=2, preempted=1))
    _job(store, "d", JobState.RECOVERING, ["n3"])  # re-forming on a node it holds: not queued
    _job(store, "e", JobState.SUCCEEDED, ["n4"])  # finished: holds nothing
    for name in ("n1", "n2", "n3", "n4", "n5"):
        _node(store, name)
    _control(store, "n1", NodeMode.DRAINING)  # job c still there: draining
    _control(store, "n3", NodeMode.CORDONED)
    _control(store, "n4", NodeMode.DRAINING)  # only a finished job on it: drained
    _control(store, "gone", NodeMode.DRAINING)  # not live: not counted
    text = metrics.render().decode()
    assert "etrain_queue_length 2.0" in text
    for job, held in (("a", 0), ("b", 0), ("c", 2), ("d", 1)):
        assert f'etrain_job_nodes{{job="{job}"}} {held}.0' in text
    assert 'etrain_job_nodes{job="e"}' not in text
    for mode, count in (("active", 2), ("cordoned", 1), ("draining", 1), ("drained", 1)):
        assert f'etrain_nodes_by_mode{{mode="{mode}"}} {count}.0' in text
    assert 'etrain_job_restarts{cause="planned",job="c"} 2.0' in text
    assert 'etrain_job_restarts{cause="preempted",job="c"} 1.0' in text

    store.clear_node_control("n1")  # read again incrementally at the next scrape
    _control(store, "n5", NodeMode.CORDONED)
    text = metrics.render().decode()
    for mode, count in (("active", 2), ("cordoned", 2), ("draining", 0), ("drained", 1)):
        assert f'etrain_nodes_by_mode{{mode="{mode}"}} {count}.0' in text


def _event(kind: str, seq: int) -> Event:
    return Event(id=f"{int(T0.timestamp() * 1_000_000):017d}-c{seq:03d}", time=T0, type=kind, message=kind)


def test_the_leader_counts_the_scheduling_actions_it_applied_and_not_refused_ones(
    store: ServiceStore, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    _job(store, "big", JobState.PENDING, [])
    _job(store, "small", JobState.RUNNING, [])
    entries = {e.record.id: e for e in store.list_jobs()}
    plan = Plan(
        updates=[
            JobUpdate(
                "small",
                entries["small"].status_revision,
                None,
                events=[_event("shrunk", 0), _event("state", 1), _event("evacuated", 2), _event("drained", 3)],
            ),
            JobUpdate(
                "big",
                entries["big"].status_revision + 100,
                None,  # stale: refused, decided again next pass
                events=[_event("preempted", 0)],
            ),
        ]
    )

    def decide(view: ClusterView, now: datetime, config: ReconcileConfig) -> Plan:
        return plan

    monkeypatch.setattr(loop, "reconcile", decide)
    controller = Controller(store, Settings(etcd=EtcdOptions("memory:0"), prefix="/etrain", replica_id="c1"), metrics)
    assert controller.tick() is not None
    text = metrics.render().decode()
    for action, count in (("shrunk", 1), ("evacuated", 1), ("preempted", 0), ("resized", 0)):
        assert f'etrain_scheduler_actions_total{{action="{action}"}} {count}.0' in text, action
    assert 'action="state"' not in text and 'action="drained"' not in text  # not a scheduling action
    assert [e.type for e in store.events("small")][-1] == "drained"  # the plan was applied


def test_every_scheduling_family_is_exposed_before_anything_happened(metrics: Metrics) -> None:
    text = metrics.render().decode()
    for family in (
        "etrain_queue_length 0.0",
        'etrain_nodes_by_mode{mode="drained"} 0.0',
        'etrain_scheduler_actions_total{action="preempted"} 0.0',
        "# TYPE etrain_job_nodes gauge",
    ):
        assert family in text, family


def test_a_status_written_by_an_older_controller_shows_zero_planned_and_preempted_restarts(
    store: ServiceStore, metrics: Metrics
) -> None:
    _job(store, "old", JobState.RUNNING, ["n1"])
    legacy = (
        '{"state": "running", "nodes": ["n1"], "restarts": {"failure": 1, "membership": 2, "in_place": 0},'
        ' "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"}'
    )
    store.client.put(store.keys.status_of("old"), legacy.encode())
    text = metrics.render().decode()
    assert 'etrain_job_restarts{cause="failure",job="old"} 1.0' in text
    assert 'etrain_job_restarts{cause="planned",job="old"} 0.0' in text
