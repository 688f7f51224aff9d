"""ServiceStore on the in-memory etcd: jobs, events, nodes, reports, progress, fenced plan writes (no etcd)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdConnectionError, MemoryEtcdClient, MemoryEtcdServer
from service.core.models import Assignment, Event, JobRecord, JobSpec, JobStatus, NodeInfo, WorkerReport
from service.core.states import JobState
from service.core.store import JobExists, ServiceStore, SubmitRaced, new_event
from service.core.view import JobUpdate, Plan

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def client() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.fixture
def store(client: MemoryEtcdClient) -> ServiceStore:
    return ServiceStore(client, "/t")


def _create(store: ServiceStore, job_id: str, at: datetime = T0) -> None:
    record = JobRecord(id=job_id, spec=JobSpec(name="job", entrypoint="train.py"), created_at=at)
    store.create_job(record, JobStatus(created_at=at, updated_at=at), new_event("submitted", "submitted", at))


def _event(event_id: str) -> Event:
    return Event(id=event_id, time=T0, type="note", message=event_id)


def _assignment(job_id: str, generation: int = 1) -> Assignment:
    spec = JobSpec(name="job", entrypoint="train.py")
    return Assignment(job_id=job_id, generation=generation, spec=spec, assigned_at=T0)


def _node(name: str) -> NodeInfo:
    return NodeInfo(name=name, capacity=2, incarnation="i", registered_at=T0)


def _fence(store: ServiceStore) -> tuple[str, int]:
    return store.keys.leader, store.client.put(store.keys.leader, b"leader")


# -- jobs --------------------------------------------------------------------------------------------
def test_a_created_job_reads_back_pending_with_its_submitted_event(store: ServiceStore) -> None:
    _create(store, "j-1")
    entry = store.get_job("j-1")
    assert entry is not None and entry.record.id == "j-1" and entry.status.state == JobState.PENDING
    assert not entry.cancel_requested
    assert [e.type for e in store.events("j-1")] == ["submitted"]


def test_creating_a_job_twice_raises_job_exists_and_keeps_the_first(store: ServiceStore) -> None:
    _create(store, "j-1", T0)
    with pytest.raises(JobExists):
        _create(store, "j-1", T0 + timedelta(hours=1))
    entry = store.get_job("j-1")
    assert entry is not None and entry.record.created_at == T0


def test_get_job_reads_the_exact_id_not_longer_ids_sharing_its_prefix(store: ServiceStore) -> None:
    _create(store, "j-10")
    assert store.get_job("j-1") is None
    _create(store, "j-1")
    assert store.get_job("j-1").record.id == "j-1"  # type: ignore[union-attr]


def test_list_jobs_orders_by_creation_time_and_skips_unreadable_records(store: ServiceStore) -> None:
    _create(store, "late", T0 + timedelta(minutes=5))
    _create(store, "early", T0)
    store.client.put(store.keys.job("broken"), b"{not json")
    store.client.put(store.keys.status_of("broken"), b"{}")
    assert [e.record.id for e in store.list_jobs()] == ["early", "late"]


def test_request_cancel_marks_the_job_and_adds_its_event(store: ServiceStore) -> None:
    _create(store, "j-1")
    store.request_cancel("j-1", new_event("cancel_requested", "by alice", T0 + timedelta(seconds=1)))
    entry = store.get_job("j-1")
    assert entry is not None and entry.cancel_requested
    assert [e.type for e in store.events("j-1")] == ["submitted", "cancel_requested"]


def test_events_come_in_id_order_and_after_and_limit_page_through_them(store: ServiceStore) -> None:
    for event_id in ("003", "001", "002", "004"):
        store.add_event("j-1", _event(event_id))
    assert [e.id for e in store.events("j-1")] == ["001", "002", "003", "004"]
    assert [e.id for e in store.events("j-1", limit=2)] == ["003", "004"]  # the newest without ``after``
    assert [e.id for e in store.events("j-1", after="001", limit=2)] == ["002", "003"]
    assert store.events("other") == []


def test_progress_is_none_until_reported_and_unreadable_progress_is_none(store: ServiceStore) -> None:
    assert store.progress("j-1") is None
    store.client.put(store.keys.progress_of("j-1"), Progress(step=7, world_size=4, time=1.0).to_json())
    progress = store.progress("j-1")
    assert progress is not None and (progress.step, progress.world_size) == (7, 4)
    store.client.put(store.keys.progress_of("j-1"), b"[1, 2]")
    assert store.progress("j-1") is None


# -- nodes, assignments, reports ---------------------------------------------------------------------
def test_a_registered_node_leaves_the_list_when_its_lease_is_revoked(store: ServiceStore) -> None:
    lease = store.client.grant_lease(timedelta(seconds=10))
    store.register_node(_node("n1"), lease)
    store.client.put(store.keys.assignment("n1", "j-1"), _assignment("j-1").model_dump_json().encode())
    nodes, jobs = store.list_nodes()
    assert [n.name for n in nodes] == ["n1"] and jobs == {"n1": ["j-1"]}
    store.client.revoke_lease(lease)
    nodes, jobs = store.list_nodes()
    assert nodes == [] and jobs == {"n1": ["j-1"]}  # assignments are the controller's to remove


def test_assignments_of_a_node_are_keyed_by_job_with_the_read_revision(store: ServiceStore) -> None:
    store.client.put(store.keys.assignment("n1", "a"), _assignment("a").model_dump_json().encode())
    revision = store.client.put(store.keys.assignment("n1", "b"), _assignment("b", 3).model_dump_json().encode())
    store.client.put(store.keys.assignment("n10", "c"), _assignment("c").model_dump_json().encode())
    assigned, read_at = store.assignments("n1")
    assert {j: a.generation for j, a in assigned.items()} == {"a": 1, "b": 3}
    assert read_at == revision + 1


def test_read_view_gathers_jobs_nodes_assignments_reports_and_progress_at_one_revision(store: ServiceStore) -> None:
    _create(store, "j-1")
    store.register_node(_node("n1"), store.client.grant_lease(timedelta(seconds=300)))
    store.client.put(store.keys.assignment("n1", "j-1"), _assignment("j-1").model_dump_json().encode())
    store.put_report(WorkerReport(job_id="j-1", node="n1", generation=1, state="running", pid=5))
    last = store.client.put(store.keys.progress_of("j-1"), Progress(step=3, world_size=1, time=1.0).to_json())
    view = store.read_view()
    assert list(view.jobs) == ["j-1"] and list(view.nodes) == ["n1"]
    assert view.assignments["n1"]["j-1"].generation == 1
    assert view.reports["j-1"]["n1"].pid == 5
    assert view.progress["j-1"].step == 3
    assert view.revision == last


# -- fenced writes -----------------------------------------------------------------------------------
def _running(store: ServiceStore, job_id: str) -> JobUpdate:
    entry = store.get_job(job_id)
    assert entry is not None
    return JobUpdate(
        job_id=job_id,
        expected_revision=entry.status_revision,
        status=entry.status.model_copy(update={"state": JobState.RUNNING, "generation": 1}),
        events=[_event("100")],
        assign={"n1": _assignment(job_id)},
    )


def test_apply_writes_status_events_and_assignments_while_the_fence_holds(store: ServiceStore) -> None:
    _create(store, "j-1")
    assert store.apply(_running(store, "j-1"), _fence(store)) is True
    assert store.get_job("j-1").status.state == JobState.RUNNING  # type: ignore[union-attr]
    assert [e.id for e in store.events("j-1")][-1] == "100"
    assert "j-1" in store.assignments("n1")[0]
    # the controller names the generation's rendezvous prefix: one for every node, whatever each agent runs
    assert store.assignments("n1")[0]["j-1"].rdzv_prefix == store.keys.rdzv


def test_apply_is_refused_when_the_status_changed_since_it_was_read(store: ServiceStore) -> None:
    _create(store, "j-1")
    stale = _running(store, "j-1")
    fence = _fence(store)
    assert store.apply(_running(store, "j-1"), fence) is True
    assert store.apply(stale, fence) is False
    assert store.events("j-1")[-1].id == "100" and len(store.events("j-1")) == 2  # the stale events not added


def test_apply_is_refused_once_the_leader_key_was_recreated_by_another_leader(store: ServiceStore) -> None:
    _create(store, "j-1")
    old = _fence(store)
    store.client.delete(store.keys.leader)
    _fence(store)
    assert store.apply(_running(store, "j-1"), old) is False
    assert store.get_job("j-1").status.state == JobState.PENDING  # type: ignore[union-attr]


def test_apply_unassigns_nodes_and_clears_the_jobs_reports(store: ServiceStore) -> None:
    _create(store, "j-1")
    fence = _fence(store)
    store.apply(_running(store, "j-1"), fence)
    store.put_report(WorkerReport(job_id="j-1", node="n1", generation=1, state="exited", exit_code=0))
    store.put_report(WorkerReport(job_id="j-10", node="n1", generation=1, state="running"))
    entry = store.get_job("j-1")
    assert entry is not None
    update = JobUpdate(
        "j-1", entry.status_revision, None, unassign=["n1"], clear_reports=True, clear_report_nodes=["n1"]
    )  # reports are keyed by node: each named
    assert store.apply(update, fence) is True
    view = store.read_view()
    assert view.assignments == {} and list(view.reports) == ["j-10"]


def test_apply_deletes_the_reports_of_the_nodes_it_names_only(store: ServiceStore) -> None:
    _create(store, "j-1")
    fence = _fence(store)
    store.apply(_running(store, "j-1"), fence)
    store.put_report(WorkerReport(job_id="j-1", node="n1", generation=1, state="exited", exit_code=-9))
    store.put_report(WorkerReport(job_id="j-1", node="n2", generation=1, state="running"))
    entry = store.get_job("j-1")
    assert entry is not None
    update = JobUpdate("j-1", entry.status_revision, None, unassign=["n1"], clear_report_nodes=["n1"])
    assert store.apply(update, fence) is True
    view = store.read_view()
    assert view.assignments == {} and list(view.reports["j-1"]) == ["n2"]


def test_apply_plan_counts_refusals_and_deletes_orphaned_assignments(store: ServiceStore) -> None:
    _create(store, "a")
    _create(store, "b")
    fence = _fence(store)
    stale_b = _running(store, "b")
    store.apply(_running(store, "b"), fence)
    store.client.put(store.keys.assignment("n2", "ghost"), _assignment("ghost").model_dump_json().encode())
    outcome = store.apply_plan(Plan(updates=[_running(store, "a"), stale_b], orphans=[("n2", "ghost")]), fence)
    assert (outcome.refused, dict(outcome.failed)) == (1, {})
    assert store.get_job("a").status.state == JobState.RUNNING  # type: ignore[union-attr]
    assert store.assignments("n2")[0] == {}


def test_apply_plan_fails_only_the_job_whose_transaction_etcd_refuses(store: ServiceStore) -> None:
    _create(store, "big")
    _create(store, "small")
    huge = _running(store, "big")
    huge.events = [_event(f"{i:04d}") for i in range(200)]  # more operations than one transaction may hold
    outcome = store.apply_plan(Plan(updates=[huge, _running(store, "small")]), _fence(store))
    assert outcome.refused == 0 and list(outcome.failed) == ["big"]
    assert store.get_job("small").status.state == JobState.RUNNING  # type: ignore[union-attr]
    assert store.get_job("big").status.state == JobState.PENDING  # type: ignore[union-attr]


def test_apply_plan_raises_when_etcd_is_unreachable(store: ServiceStore, client: MemoryEtcdClient) -> None:
    _create(store, "j-1")
    update, fence = _running(store, "j-1"), _fence(store)
    client.set_reachable(False)
    with pytest.raises(EtcdConnectionError):
        store.apply_plan(Plan(updates=[update]), fence)


def _pending(store: ServiceStore, job_id: str, user: str) -> tuple[JobRecord, JobStatus, Event]:
    spec = JobSpec(name="j", entrypoint="t.py")
    record = JobRecord(id=job_id, spec=spec, created_at=T0, submitted_by=user)
    return record, JobStatus(state=JobState.PENDING, created_at=T0, updated_at=T0), _event("submitted")


def test_a_users_submit_checked_on_a_read_another_of_its_submits_outdated_is_refused_unwritten(
    store: ServiceStore,
) -> None:
    """Two submits of carol read the same jobs (both would pass a cap of one pending job); the first commits, the
    second's write is refused (SubmitRaced) and stores nothing, so its caller checks again on a fresh read."""
    jobs_a, rev_a = store.jobs_for_submit("carol")
    jobs_b, rev_b = store.jobs_for_submit("carol")
    assert jobs_a == jobs_b == [] and rev_a == rev_b == 0
    store.create_job(*_pending(store, "a-1", "carol"), submitter=("carol", rev_a))
    with pytest.raises(SubmitRaced):
        store.create_job(*_pending(store, "b-1", "carol"), submitter=("carol", rev_b))
    assert store.get_job("b-1") is None
    jobs, rev = store.jobs_for_submit("carol")
    assert [e.record.id for e in jobs] == ["a-1"] and rev > 0
    store.create_job(*_pending(store, "c-1", "carol"), submitter=("carol", rev))  # a fresh read commits
    # another user's submits are not held by carol's, and a taken id is still JobExists
    dave = store.jobs_for_submit("dave")[1]
    store.create_job(*_pending(store, "d-1", "dave"), submitter=("dave", dave))
    with pytest.raises(JobExists):
        store.create_job(*_pending(store, "d-1", "dave"), submitter=("dave", store.jobs_for_submit("dave")[1]))
    # a user name that prefixes another's has a key of its own
    assert store.jobs_for_submit("car")[1] == 0 and store.keys.submitter("a/b") == store.keys.submitters + "a%2Fb"


def test_a_node_record_on_no_lease_is_no_node_and_draws_no_job(store: ServiceStore) -> None:
    """Before, a ``nodes/evil`` record written without a lease (by anyone who may write ``nodes/``) was listed and
    drew a real job's assignment (M3): only a lease says an agent is alive."""
    store.client.put(store.keys.node("evil"), _node("evil").model_dump_json().encode())
    store.register_node(_node("n1"), store.client.grant_lease(timedelta(seconds=300)))
    assert set(store.read_view().nodes) == {"n1"}
    assert [n.name for n in store.list_nodes()[0]] == ["n1"]
