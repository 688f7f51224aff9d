"""Regressions found by the store fuzzer (``test_store_fuzz.py``), each on the real etcd: a record that validates
but cannot be used is ignored like an unreadable one, and a record under one job's (node's) key never acts for
another job (node)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest

from service.core.models import Assignment, JobRecord, JobSpec, JobStatus, NodeInfo, WorkerReport
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from tests.fuzz.conftest import StoreHarness

pytestmark = pytest.mark.timeout(60)


def _submit(store: ServiceStore, job_id: str, **record: Any) -> None:
    now = datetime.now(timezone.utc)
    rec = JobRecord(id=job_id, spec=JobSpec(name="a", entrypoint="t.py"), created_at=now)
    store.create_job(rec, JobStatus(created_at=now, updated_at=now), new_event("submitted", "test", now))
    if record:
        value = {**json.loads(rec.model_dump_json()), **record}
        store.client.put(store.keys.job(job_id), json.dumps(value).encode())


def _state(store: ServiceStore, job_id: str) -> JobStatus:
    entry = store.get_job(job_id)
    assert entry is not None
    return entry.status


def _reads_answer(h: StoreHarness, *paths: str) -> None:
    for path in ("/v1/jobs", "/v1/nodes", "/metrics", *paths):
        response = h.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])


def test_a_job_created_at_without_time_zone_is_ignored_and_neither_the_pass_nor_the_job_list_fails(
    etcd_harness: StoreHarness,
) -> None:
    # was: TypeError "can't compare offset-naive and offset-aware datetimes" sorting the jobs, in tick() and
    # in GET /v1/jobs (500)
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "naive-1", created_at="2025-01-01T00:00:00")
    _submit(store, "good-1")
    assert h.controller.tick() is not None
    assert _state(store, "good-1").state == JobState.RUNNING
    assert store.get_job("naive-1") is None
    _reads_answer(h, "/v1/jobs?limit=1")


@pytest.mark.parametrize("created_at", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+14:00"])
def test_a_job_created_at_beyond_the_utc_range_is_ignored_and_job_pages_answer(
    etcd_harness: StoreHarness, created_at: str
) -> None:
    # was: OverflowError in the page cursor (created_at in UTC) of GET /v1/jobs?limit=1 and ?after= (500)
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "far-1", created_at=created_at)
    _submit(store, "good-1")
    assert h.controller.tick() is not None
    _reads_answer(h, "/v1/jobs?limit=1", "/v1/jobs?after=0")


def test_a_status_whose_blacklist_time_has_no_time_zone_is_ignored_and_the_pass_goes_on(
    etcd_harness: StoreHarness,
) -> None:
    # was: TypeError comparing the blacklist's naive time with the controller's clock, escaping tick()
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "naive-1")
    status = json.loads(store.get_job("naive-1").status.model_dump_json())  # type: ignore[union-attr]
    store.client.put(
        store.keys.status_of("naive-1"), json.dumps({**status, "blacklist": {"n1": "2025-01-01T00:00:00"}}).encode()
    )
    _submit(store, "good-1")
    assert h.controller.tick() is not None
    assert _state(store, "good-1").state == JobState.RUNNING
    _reads_answer(h)


@pytest.mark.parametrize("where", ["node capacity", "job step"])
def test_an_integer_beyond_64_bits_is_ignored_and_metrics_answer(etcd_harness: StoreHarness, where: str) -> None:
    # was: OverflowError "int too large to convert to float" in GET /metrics (500)
    h, store = etcd_harness, etcd_harness.store
    if where == "node capacity":
        node = NodeInfo(name="big", capacity=1, incarnation="x", registered_at=datetime.now(timezone.utc))
        store.client.put(
            store.keys.node("big"), node.model_dump_json().replace('"capacity":1', f'"capacity":{10**400}').encode()
        )
    else:
        _submit(store, "big-1")
        status = json.loads(store.get_job("big-1").status.model_dump_json())  # type: ignore[union-attr]
        store.client.put(store.keys.status_of("big-1"), json.dumps({**status, "step": 10**400}).encode())
    assert h.controller.tick() is not None
    _reads_answer(h)


def test_a_job_record_under_another_jobs_key_is_not_listed_as_that_job(etcd_harness: StoreHarness) -> None:
    # was: jobs/<victim> holding a record with id <bystander> listed the bystander twice (GET /v1/jobs) and gave
    # the reconciler a second decision for it, with the victim's status
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "bystander-1")
    _submit(store, "victim-1", id="bystander-1")
    assert h.controller.tick() is not None
    assert [j["id"] for j in h.get("/v1/jobs").json()["jobs"]] == ["bystander-1"]
    assert _state(store, "bystander-1").state == JobState.RUNNING


def test_a_failure_report_under_another_jobs_key_does_not_restart_the_job_it_names(
    etcd_harness: StoreHarness,
) -> None:
    # was: reports/<victim>/<node> holding a failed report for <bystander> made the bystander's generation fail
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "bystander-1")
    _submit(store, "victim-1")
    h.controller.tick()
    running = _state(store, "bystander-1")
    node = running.nodes[0]
    report = WorkerReport(job_id="bystander-1", node=node, generation=1, state="exited", exit_code=1)
    store.client.put(store.keys.report("victim-1", node), report.model_dump_json().encode())
    h.controller.tick()
    after = _state(store, "bystander-1")
    assert (after.state, after.generation, after.nodes) == (JobState.RUNNING, 1, running.nodes)


def test_assignments_under_another_jobs_key_do_not_use_up_the_nodes_of_the_job_they_name(
    etcd_harness: StoreHarness,
) -> None:
    # was: assign/<node>/<ghost> naming job <bystander> counted against the nodes' free slots as the bystander's,
    # so the bystander never started (and the assignment, naming a known job, was never removed as an orphan)
    h, store = etcd_harness, etcd_harness.store
    _submit(store, "bystander-1")
    spec = JobSpec(name="a", entrypoint="t.py", nproc_per_node=8)
    for node in ("n1", "n2"):
        ghost = Assignment(job_id="bystander-1", generation=7, spec=spec, assigned_at=datetime.now(timezone.utc))
        store.client.put(store.keys.assignment(node, "ghost-1"), ghost.model_dump_json().encode())
    h.controller.tick()
    assert _state(store, "bystander-1").state == JobState.RUNNING


def test_a_node_record_under_another_nodes_key_does_not_stand_for_that_node(etcd_harness: StoreHarness) -> None:
    # was: nodes/<x> holding a record named n1 with no capacity replaced the live n1 in the controller's view,
    # so no job could start on n1 (nor, with n2 shadowed too, anywhere)
    h, store = etcd_harness, etcd_harness.store
    now = datetime.now(timezone.utc)
    for key, name in (("x1", "n1"), ("x2", "n2")):
        fake = NodeInfo(name=name, capacity=0, incarnation="x", registered_at=now)
        store.client.put(store.keys.node(key), fake.model_dump_json().encode())
    _submit(store, "bystander-1")
    h.controller.tick()
    assert _state(store, "bystander-1").state == JobState.RUNNING
