"""``POST /v1/nodes/{name}/cordon|drain|uncordon`` and the modes ``GET /v1/nodes`` shows, against a real etcd.

The app here runs no reconcile loop (``run_controller=False``): the tests write the assignments and statuses the
leader would, so that each mode (active, cordoned, draining, drained) is reached on purpose, not by timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from service.core.keys import dump
from service.core.models import Assignment, JobSpec, JobStatus, NodeInfo, NodeMode
from service.core.states import JobState
from service.core.store import ServiceStore
from tests.service.conftest import ADMIN, READER, make_settings

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SPEC: dict[str, Any] = {"name": "train", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}
ACTIONS = ("cordon", "drain", "uncordon")


@pytest.fixture
def quiet(etcd_server: LocalEtcdCluster, key_prefix: str) -> Iterator[TestClient]:
    settings = make_settings(etcd_server, key_prefix, run_controller=False)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        yield client


def _store(client: TestClient) -> ServiceStore:
    store: ServiceStore = client.app.state.store  # type: ignore[attr-defined]
    return store


def _register(client: TestClient, name: str, capacity: int = 4) -> None:
    store = _store(client)  # on a lease, as an agent registers (a record on none is no node)
    lease = store.client.grant_lease(timedelta(seconds=300))
    store.register_node(NodeInfo(name=name, capacity=capacity, incarnation="i", registered_at=T0), lease)


def _assign(client: TestClient, node: str, job_id: str) -> None:
    """What the leader writes when it places the job on the node: the assignment and the job's status."""
    store = _store(client)
    spec = JobSpec.model_validate(SPEC)
    store.client.put(
        store.keys.assignment(node, job_id), dump(Assignment(job_id=job_id, generation=1, spec=spec, assigned_at=T0))
    )
    _set_state(client, job_id, JobState.RUNNING, [node])


def _set_state(client: TestClient, job_id: str, state: JobState, nodes: list[str]) -> None:
    store = _store(client)
    store.client.put(
        store.keys.status_of(job_id),
        dump(JobStatus(state=state, nodes=nodes, generation=1, created_at=T0, updated_at=T0)),
    )


def _nodes(client: TestClient) -> dict[str, dict[str, Any]]:
    resp = client.get("/v1/nodes")
    assert resp.status_code == 200, resp.text
    return {n["name"]: n for n in resp.json()["nodes"]}


def _op(client: TestClient, name: str, action: str, reason: str | None = None) -> dict[str, Any]:
    resp = client.post(f"/v1/nodes/{name}/{action}", json={"reason": reason} if reason else None)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_cordon_drain_uncordon_round_trip_shows_each_mode_and_who_asked(quiet: TestClient) -> None:
    _register(quiet, "n1")
    _register(quiet, "n2")
    assert {n: v["mode"] for n, v in _nodes(quiet).items()} == {"n1": "active", "n2": "active"}

    node = _op(quiet, "n1", "cordon", "swap a disk")
    assert (node["name"], node["mode"], node["live"], node["changed"]) == ("n1", "cordoned", True, True)
    assert (node["reason"], node["mode_requested_by"]) == ("swap a disk", "alice")
    assert node["message"] == "node n1 cordoned" and node["mode_since"] is not None
    listed = _nodes(quiet)
    assert (listed["n1"]["mode"], listed["n1"]["reason"], listed["n2"]["mode"]) == ("cordoned", "swap a disk", "active")
    assert listed["n1"]["capacity"] == 4 and listed["n1"]["free"] == 4  # a cordon changes no capacity
    control = _store(quiet).node_control("n1")
    assert control is not None and control.mode == NodeMode.CORDONED and control.requested_by == "alice"

    node = _op(quiet, "n1", "drain")
    assert node["mode"] == "drained" and node["changed"] is True  # nothing runs there: drained at once
    assert "no active job" in node["message"]
    assert _nodes(quiet)["n1"]["mode"] == "drained"

    node = _op(quiet, "n1", "uncordon")
    assert node["mode"] == "active" and node["changed"] is True and "was draining" in node["message"]
    assert node["reason"] is None and _store(quiet).node_control("n1") is None
    assert _nodes(quiet)["n1"]["mode"] == "active"


def test_uncordon_of_a_node_without_a_request_is_200_and_says_so(quiet: TestClient) -> None:
    _register(quiet, "n1")
    node = _op(quiet, "n1", "uncordon")
    assert node["changed"] is False and node["mode"] == "active"
    assert node["message"] == "node n1 had no cordon or drain request: nothing to do"


def test_asking_again_for_the_same_mode_writes_nothing(quiet: TestClient) -> None:
    _register(quiet, "n1")
    first = _op(quiet, "n1", "cordon", "maintenance")
    again = _op(quiet, "n1", "cordon")
    assert again["changed"] is False and again["message"] == "node n1 is already cordoned"
    assert again["mode_since"] == first["mode_since"] and again["reason"] == "maintenance"
    changed = _op(quiet, "n1", "cordon", "a new reason")  # a new reason is recorded
    assert changed["changed"] is True and changed["reason"] == "a new reason"


def test_drain_is_draining_while_an_active_job_holds_the_node_then_drained(quiet: TestClient) -> None:
    _register(quiet, "n1", capacity=2)
    job = quiet.post("/v1/jobs", json=SPEC).json()
    _assign(quiet, "n1", job["id"])

    node = _op(quiet, "n1", "drain", "kernel update")
    assert node["mode"] == "draining" and node["jobs"] == [job["id"]] and node["free"] == 1
    assert node["message"] == f"node n1 draining: 1 active job(s) move off it ({job['id']})"
    events = quiet.get(f"/v1/jobs/{job['id']}/events").json()["events"]
    assert events[-1]["type"] == "drain_requested"
    assert events[-1]["message"] == "node n1 is being drained by alice: kernel update: the job moves off it"
    assert events[-1]["data"] == {"node": "n1"}
    assert _nodes(quiet)["n1"]["mode"] == "draining"

    _set_state(quiet, job["id"], JobState.CANCELLED, [])  # finished: its assignment no longer holds the node
    assert _nodes(quiet)["n1"]["mode"] == "drained"
    _store(quiet).client.delete(_store(quiet).keys.assignment("n1", job["id"]))
    assert _nodes(quiet)["n1"]["mode"] == "drained"


def test_cordon_over_a_drain_stops_the_drain(quiet: TestClient) -> None:
    _register(quiet, "n1")
    _op(quiet, "n1", "drain")
    node = _op(quiet, "n1", "cordon")
    assert node["mode"] == "cordoned" and "no longer draining" in node["message"]


def test_a_request_may_name_a_node_not_registered_and_it_is_listed_as_not_live(quiet: TestClient) -> None:
    node = _op(quiet, "gpu-17.rack-2", "cordon", "burn-in first")
    assert (node["live"], node["mode"], node["capacity"], node["registered_at"]) == (False, "cordoned", 0, None)
    assert "no agent of this name is registered now" in node["message"]
    listed = _nodes(quiet)["gpu-17.rack-2"]
    assert (listed["live"], listed["mode"], listed["reason"]) == (False, "cordoned", "burn-in first")

    _register(quiet, "gpu-17.rack-2", capacity=8)  # it joins: cordoned from its first moment
    listed = _nodes(quiet)["gpu-17.rack-2"]
    assert (listed["live"], listed["mode"], listed["capacity"]) == (True, "cordoned", 8)


def test_a_drained_node_that_went_away_stays_listed_until_uncordoned(quiet: TestClient) -> None:
    _register(quiet, "n1")
    _register(quiet, "n2")
    _op(quiet, "n1", "drain")
    store = _store(quiet)
    store.client.delete(store.keys.node("n1"))  # the agent stopped (its lease ended)
    listed = _nodes(quiet)
    assert (listed["n1"]["live"], listed["n1"]["mode"], listed["n1"]["free"]) == (False, "drained", 0)
    assert listed["n2"]["live"] is True
    node = _op(quiet, "n1", "uncordon")
    assert node["live"] is False and node["mode"] == "active" and node["changed"] is True
    assert set(_nodes(quiet)) == {"n2"}  # neither live nor requested: gone from the list


def test_uncordon_of_an_unknown_node_without_request_is_200(quiet: TestClient) -> None:
    node = _op(quiet, "never-seen", "uncordon")
    assert (node["name"], node["live"], node["changed"], node["mode"]) == ("never-seen", False, False, "active")


@pytest.mark.parametrize("action", ACTIONS)
def test_a_read_token_cannot_cordon_drain_or_uncordon(quiet: TestClient, action: str) -> None:
    _register(quiet, "n1")
    _op(quiet, "n1", "cordon")
    resp = quiet.post(f"/v1/nodes/n1/{action}", headers={"Authorization": f"Bearer {READER}"})
    assert resp.status_code == 403 and "read-only" in resp.json()["detail"]
    assert _nodes(quiet)["n1"]["mode"] == "cordoned"  # unchanged
    assert quiet.post(f"/v1/nodes/n1/{action}", headers={"Authorization": ""}).status_code == 401


@pytest.mark.parametrize("name", ["bad name", "-leading-dash", "trailing.", "x" * 64, "caf%C3%A9", "ends_"])
def test_a_bad_node_name_is_422(quiet: TestClient, name: str) -> None:
    for action in ACTIONS:
        resp = quiet.post(f"/v1/nodes/{name}/{action}")
        assert resp.status_code == 422, (action, resp.text)
        assert resp.json()["message"].startswith("name:")
    assert _store(quiet).node_controls() == {}


@pytest.mark.parametrize(
    "body", [{"reason": "x" * 1001}, {"reason": "ok", "force": True}, {"reason": 5}], ids=["long", "unknown", "type"]
)
def test_a_bad_body_is_422(quiet: TestClient, body: dict[str, Any]) -> None:
    resp = quiet.post("/v1/nodes/n1/drain", json=body)
    assert resp.status_code == 422, resp.text
    assert _store(quiet).node_controls() == {}


def test_the_new_routes_are_in_the_openapi_document(quiet: TestClient) -> None:
    paths = quiet.get("/openapi.json").json()["paths"]
    assert {f"/v1/nodes/{{name}}/{a}" for a in ACTIONS} <= set(paths)
    assert "patch" in paths["/v1/jobs/{job_id}"]
