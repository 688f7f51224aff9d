"""``PATCH /v1/jobs/{id}``: resizing a job's min_nodes / max_nodes, against a real etcd (no reconcile loop: the
statuses a leader would write are written by the tests)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from service.core.keys import dump
from service.core.models import JobStatus
from service.core.states import JobState
from service.core.store import ServiceStore
from tests.service.conftest import ADMIN, READER, make_settings

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SPEC: dict[str, Any] = {
    "name": "train",
    "entrypoint": "train.py",
    "min_nodes": 1,
    "max_nodes": 3,
    "priority": 10,
    "queue": "team-a",
}


@pytest.fixture
def quiet(etcd_server: LocalEtcdCluster, key_prefix: str) -> Iterator[TestClient]:
    settings = make_settings(etcd_server, key_prefix, run_controller=False)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        yield client


def _store(client: TestClient) -> ServiceStore:
    store: ServiceStore = client.app.state.store  # type: ignore[attr-defined]
    return store


def _submit(client: TestClient) -> str:
    resp = client.post("/v1/jobs", json=SPEC)
    assert resp.status_code == 201, resp.text
    job_id: str = resp.json()["id"]
    return job_id


def test_resize_changes_the_stored_spec_adds_an_event_and_answers_the_job(quiet: TestClient) -> None:
    job_id = _submit(quiet)
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"min_nodes": 2, "max_nodes": 2})
    assert resp.status_code == 200, resp.text
    job = resp.json()
    assert (job["id"], job["spec"]["min_nodes"], job["spec"]["max_nodes"]) == (job_id, 2, 2)
    assert (job["spec"]["priority"], job["spec"]["queue"]) == (10, "team-a")  # the job view shows both
    entry = _store(quiet).get_job(job_id)
    assert entry is not None and (entry.record.spec.min_nodes, entry.record.spec.max_nodes) == (2, 2)
    assert entry.record.spec.entrypoint == "train.py" and entry.record.checkpoint_key  # the rest of the record kept
    events = quiet.get(f"/v1/jobs/{job_id}/events").json()["events"]
    assert events[-1]["type"] == "resize"
    assert events[-1]["message"] == "min_nodes 1 -> 2, max_nodes 3 -> 2 (by alice)"
    assert quiet.get(f"/v1/jobs/{job_id}").json()["spec"]["max_nodes"] == 2


def test_resize_of_a_running_job_keeps_its_status(quiet: TestClient) -> None:
    job_id = _submit(quiet)
    store = _store(quiet)
    running = JobStatus(state=JobState.RUNNING, nodes=["n1", "n2"], generation=3, created_at=T0, updated_at=T0)
    store.client.put(store.keys.status_of(job_id), dump(running))
    job = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 5}).json()
    assert (job["state"], job["nodes"], job["generation"], job["spec"]["max_nodes"]) == ("running", ["n1", "n2"], 3, 5)


def test_resize_to_the_same_sizes_is_200_without_an_event(quiet: TestClient) -> None:
    job_id = _submit(quiet)
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 3})
    assert resp.status_code == 200 and resp.json()["spec"]["max_nodes"] == 3
    assert [e["type"] for e in quiet.get(f"/v1/jobs/{job_id}/events").json()["events"]] == ["submitted"]


def test_resize_of_an_unknown_job_is_404(quiet: TestClient) -> None:
    resp = quiet.patch("/v1/jobs/nope-1", json={"max_nodes": 2})
    assert resp.status_code == 404 and "nope-1" in resp.json()["detail"]


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_resize_of_a_finished_job_is_409(quiet: TestClient, state: JobState) -> None:
    job_id = _submit(quiet)
    store = _store(quiet)
    store.client.put(store.keys.status_of(job_id), dump(JobStatus(state=state, created_at=T0, updated_at=T0)))
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2})
    assert resp.status_code == 409
    assert resp.json()["detail"] == f"job {job_id} already {state.value}: it cannot be resized"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_nodes": 4}, "max_nodes"),  # above the current max_nodes
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes"),
        ({"max_nodes": 61}, "max_nodes"),  # over the per-job limit of a submit
        ({"max_nodes": 5000}, "max_nodes"),  # over the model's limit
        ({"min_nodes": 0}, "min_nodes"),
        ({"min_nodes": "two"}, "min_nodes"),
        ({"max_nodes": 2, "name": "other"}, "name"),  # only the node bounds can change
        ({}, ""),
        ({"min_nodes": None, "max_nodes": None}, ""),
    ],
    ids=[
        "min-above-max",
        "max-below-min",
        "per-job-limit",
        "model-limit",
        "min-zero",
        "not-int",
        "other-field",
        "empty",
        "nulls",
    ],
)
def test_an_invalid_resize_is_422_naming_the_field_and_changes_nothing(
    quiet: TestClient, body: dict[str, Any], field: str
) -> None:
    job_id = _submit(quiet)
    resp = quiet.patch(f"/v1/jobs/{job_id}", json=body)
    assert resp.status_code == 422, resp.text
    message = resp.json()["message"]
    assert message.startswith(f"{field}:" if field else "body:"), message
    spec = quiet.get(f"/v1/jobs/{job_id}").json()["spec"]
    assert (spec["min_nodes"], spec["max_nodes"]) == (1, 3)


def test_a_read_token_cannot_resize(quiet: TestClient) -> None:
    job_id = _submit(quiet)
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2}, headers={"Authorization": f"Bearer {READER}"})
    assert resp.status_code == 403
    assert quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2}, headers={"Authorization": ""}).status_code == 401


def test_a_resize_that_keeps_losing_a_race_is_409_and_one_that_loses_once_succeeds(
    quiet: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _submit(quiet)
    store = _store(quiet)
    key = store.keys.job(job_id)
    kv, _ = store.client.get(key)
    assert kv is not None
    original = store.client.commit
    races = {"left": 100}

    def commit(*args: Any, **kwargs: Any) -> Any:
        if races["left"] > 0:
            races["left"] -= 1
            store.client.put(key, kv.value)  # another replica rewrote the record meanwhile
        return original(*args, **kwargs)

    monkeypatch.setattr(store.client, "commit", commit)
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2})
    assert resp.status_code == 409 and "retry" in resp.json()["detail"]
    assert quiet.get(f"/v1/jobs/{job_id}").json()["spec"]["max_nodes"] == 3
    races["left"] = 1
    resp = quiet.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 2})
    assert resp.status_code == 200 and resp.json()["spec"]["max_nodes"] == 2
    assert [e["type"] for e in quiet.get(f"/v1/jobs/{job_id}/events").json()["events"]] == ["submitted", "resize"]
