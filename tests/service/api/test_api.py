"""Every REST endpoint against a real etcd, with the reconcile loop running: auth, validation, 404s."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.etcd import create_client
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_for
from service.agent.node import create_agent
from service.api.app import create_app
from service.core.config import AgentSettings, EtcdOptions, Settings
from tests.service.conftest import ADMIN, READER, make_settings

pytestmark = pytest.mark.timeout(60)

SPEC: dict[str, Any] = {"name": "train", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}

ENDPOINTS = [
    ("GET", "/v1/jobs"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs/some-id"),
    ("POST", "/v1/jobs/some-id/cancel"),
    ("GET", "/v1/jobs/some-id/events"),
    ("GET", "/v1/nodes"),
]


def _call(api: TestClient, method: str, path: str, token: str | None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {"Authorization": ""}
    return api.request(method, path, headers=headers, json=SPEC if method == "POST" else None)


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_missing_token_is_401_with_bearer_challenge(api: TestClient, method: str, path: str) -> None:
    resp = _call(api, method, path, None)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_wrong_token_is_401(api: TestClient, method: str, path: str) -> None:
    resp = _call(api, method, path, "not-a-token")
    assert resp.status_code == 401
    assert "invalid" in resp.json()["detail"]


def test_invalid_body_without_token_is_still_401(api: TestClient) -> None:
    resp = api.post("/v1/jobs", json={"name": "BAD"}, headers={"Authorization": ""})
    assert resp.status_code == 401


@pytest.mark.parametrize(("method", "path"), [e for e in ENDPOINTS if e[0] == "POST"])
def test_read_token_cannot_change_anything(api: TestClient, method: str, path: str) -> None:
    resp = _call(api, method, path, READER)
    assert resp.status_code == 403 and "read-only" in resp.json()["detail"]


def test_read_token_can_read(api: TestClient) -> None:
    job = api.post("/v1/jobs", json=SPEC).json()
    for path in ("/v1/jobs", f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events", "/v1/nodes"):
        assert _call(api, "GET", path, READER).status_code == 200, path


def test_probes_and_docs_need_no_token_metrics_a_read_token(api: TestClient) -> None:
    bare = {"Authorization": ""}
    assert api.get("/healthz", headers=bare).json() == {"status": "ok"}
    ready = wait_for(lambda: api.get("/readyz", headers=bare).json().get("ready"))
    assert ready is True
    body = api.get("/readyz", headers=bare).json()
    assert body["etcd"] == "ok" and body["is_leader"] is True and body["leader"] == body["replica"]
    assert api.get("/docs", headers=bare).status_code == 200
    paths = api.get("/openapi.json", headers=bare).json()["paths"]
    assert {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/nodes",
    } <= set(paths)
    assert api.get("/metrics", headers=bare).status_code == 401  # its labels name the jobs
    metrics = api.get("/metrics", headers={"Authorization": f"Bearer {READER}"})
    assert metrics.status_code == 200 and "etrain_jobs{" in metrics.text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "Not_Valid"}, "name"),
        ({"entrypoint": ""}, "entrypoint"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"env": {"RANK": "3"}}, "env"),
        ({"env": {"ETRAIN_CHECKPOINT_URL": "/x"}}, "env"),
        ({"checkpoint_url": "ftp://host/x"}, "checkpoint_url"),
        ({"checkpoint_url": "relative/path"}, "checkpoint_url"),
        ({"restart_policy": {"backoff_initial": -1}}, "restart_policy.backoff_initial"),
        ({"restart_policy": {"max_failures": -1}}, "restart_policy.max_failures"),
        ({"lr_policy": {"scaling": "cubic"}}, "lr_policy.scaling"),
        ({"rendezvous": {"last_call_timeout": 0}}, "rendezvous.last_call_timeout"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"args": "not-a-list"}, "args"),
        # no process can be given a NUL byte: the launch failed on every node the job landed on (the agents crashed)
        ({"env": {"X": "a\u0000b"}}, "env.X"),
        ({"args": ["--ok", "a\u0000b"]}, "args.1"),
        ({"working_dir": "/tmp/a\u0000b"}, "working_dir"),
        # a spec of ~1 MB (padding in env) multiplied by retained jobs took etcd's reads past their 4 MiB limit
        ({"env": {"PAD": "x" * 70_000}}, "spec"),
    ],
)
def test_invalid_spec_is_422_naming_the_field(api: TestClient, change: dict[str, Any], field: str) -> None:
    resp = api.post("/v1/jobs", json={**SPEC, **change})
    assert resp.status_code == 422
    body = resp.json()
    locs = [".".join(str(p) for p in e["loc"][1:]) for e in body["detail"]]
    assert field in locs, body
    assert body["message"].startswith(field + ":")
    assert api.get("/v1/jobs").json()["jobs"] == []  # nothing was stored


def test_missing_required_fields_are_each_named(api: TestClient) -> None:
    resp = api.post("/v1/jobs", json={})
    assert resp.status_code == 422
    assert {e["loc"][-1] for e in resp.json()["detail"]} == {"name", "entrypoint"}


def test_checkpoint_url_outside_the_service_root_is_422(api: TestClient, settings: Settings) -> None:
    resp = api.post("/v1/jobs", json={**SPEC, "checkpoint_url": "file:///elsewhere/x"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "checkpoint_url"]


def test_checkpoint_prefix_of_an_active_job_cannot_be_reused(api: TestClient, settings: Settings) -> None:
    first = api.post("/v1/jobs", json=SPEC).json()
    url = first["checkpoint"]["url"]
    assert url == f"{settings.checkpoint_root}/{first['id']}"  # default: <root>/<job id>
    for other in (url, url + "/nested"):
        resp = api.post("/v1/jobs", json={**SPEC, "checkpoint_url": other})
        assert resp.status_code == 409 and first["id"] in resp.json()["detail"]
    api.post(f"/v1/jobs/{first['id']}/cancel")
    wait_for(lambda: api.get(f"/v1/jobs/{first['id']}").json()["state"] == "cancelled")
    assert api.post("/v1/jobs", json={**SPEC, "checkpoint_url": url}).status_code == 201  # free again


def test_submit_then_list_and_get_show_the_job(api: TestClient) -> None:
    resp = api.post("/v1/jobs", json={**SPEC, "args": ["--lr", "0.1"], "env": {"FOO": "bar"}})
    assert resp.status_code == 201
    job = resp.json()
    assert job["id"].startswith("train-") and job["state"] == "pending" and job["submitted_by"] == "alice"
    assert job["spec"]["args"] == ["--lr", "0.1"] and job["spec"]["restart_policy"]["backoff_initial"] == 2.0
    assert job["world_size"] == {"current": None, "expected": None, "history": []}
    assert job["restart_budget"]["failures_left"] == 3
    listed = api.get("/v1/jobs").json()["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]
    got = api.get(f"/v1/jobs/{job['id']}").json()
    assert got["spec"] == job["spec"] and got["checkpoint"]["url"] == job["checkpoint"]["url"]
    # no node is registered: the leader keeps it pending and says why
    msg = wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["message"].startswith("waiting for nodes"))
    assert msg
    assert api.get("/v1/jobs", params={"state": "running"}).json()["jobs"] == []
    assert len(api.get("/v1/jobs", params={"state": "pending"}).json()["jobs"]) == 1
    assert api.get("/v1/jobs", params={"state": "nonsense"}).status_code == 422


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/nope-1234"),
        ("POST", "/v1/jobs/nope-1234/cancel"),
        ("GET", "/v1/jobs/nope-1234/events"),
    ],
)
def test_unknown_job_id_is_404(api: TestClient, method: str, path: str) -> None:
    resp = api.request(method, path)
    assert resp.status_code == 404 and "nope-1234" in resp.json()["detail"]


def test_prefix_of_an_existing_id_is_not_that_job(api: TestClient) -> None:
    job = api.post("/v1/jobs", json=SPEC).json()
    assert api.get(f"/v1/jobs/{job['id'][:-1]}").status_code == 404


def test_cancel_is_applied_by_the_leader_and_recorded_in_events(api: TestClient) -> None:
    job = api.post("/v1/jobs", json=SPEC).json()
    resp = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert resp.status_code == 202 and resp.json()["cancel_requested"] is True
    wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled")
    again = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    events = api.get(f"/v1/jobs/{job['id']}/events").json()["events"]
    assert [e["type"] for e in events] == ["submitted", "cancel_requested", "state"]
    assert events[1]["message"] == "cancel requested by alice"
    assert events[2]["data"] == {"old": "pending", "new": "cancelled"}
    later = api.get(f"/v1/jobs/{job['id']}/events", params={"after": events[0]["id"]}).json()["events"]
    assert [e["id"] for e in later] == [e["id"] for e in events[1:]]


def test_nodes_lists_registered_agents_until_they_leave(api: TestClient, settings: Settings, tmp_path: Path) -> None:
    agent = create_agent(
        AgentSettings(
            etcd=settings.etcd,
            node_name="gpu-7",
            prefix=settings.prefix,
            nproc_per_node=4,
            work_dir=tmp_path,
            lease_ttl=timedelta(seconds=2),
        )
    )
    agent.register()
    try:
        nodes = api.get("/v1/nodes").json()["nodes"]
        assert [(n["name"], n["capacity"], n["free"], n["jobs"]) for n in nodes] == [("gpu-7", 4, 4, [])]
        job = api.post("/v1/jobs", json={**SPEC, "nproc_per_node": 3}).json()
        # the leader assigns the job to the node (no agent loop runs: nothing is started)
        wait_for(lambda: api.get("/v1/nodes").json()["nodes"][0]["jobs"] == [job["id"]])
        assert api.get("/v1/nodes").json()["nodes"][0]["free"] == 1
        assert api.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
    finally:
        agent.shutdown()
    assert api.get("/v1/nodes").json()["nodes"] == []  # clean exit revokes the lease at once


def test_metrics_count_requests_and_jobs(api: TestClient) -> None:
    api.post("/v1/jobs", json=SPEC)
    api.get("/v1/jobs/nope-1")
    text = api.get("/metrics").text
    assert 'etrain_http_requests_total{method="POST",route="/v1/jobs",status="201"} 1.0' in text
    assert 'etrain_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0' in text
    assert 'etrain_jobs{state="pending"} 1.0' in text
    assert "etrain_nodes 0.0" in text
    wait_for(lambda: "etrain_leader 1.0" in api.get("/metrics").text)


def test_without_tokens_auth_is_off(etcd_server: LocalEtcdCluster, key_prefix: str) -> None:
    settings = make_settings(etcd_server, key_prefix, tokens=None, run_controller=False)
    with TestClient(create_app(settings)) as client:
        resp = client.post("/v1/jobs", json=SPEC)
        assert resp.status_code == 201 and resp.json()["submitted_by"] == "anonymous"
        # this replica does not reconcile: ready without a leader, the job stays as submitted
        assert client.get("/readyz").json()["ready"] is True


def test_etcd_outage_during_a_request_is_503(tmp_path: Path, key_prefix: str) -> None:
    (tmp_path / "etcd").mkdir()
    etcd = LocalEtcdCluster(1, workdir=tmp_path / "etcd").start()
    try:
        settings = make_settings(etcd, key_prefix, run_controller=False)
        client_cfg = settings.etcd.config()
        fast = create_client(type(client_cfg)(**{**client_cfg.__dict__, "op_timeout": timedelta(seconds=1)}))
        with TestClient(create_app(settings, client=fast), headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            assert c.get("/v1/jobs").status_code == 200
            etcd.stop_member(0)
            resp = c.get("/v1/jobs")
            assert resp.status_code == 503 and "etcd unavailable" in resp.json()["detail"]
            assert c.get("/readyz").status_code == 503
            assert c.get("/healthz").status_code == 200
        fast.close()
    finally:
        etcd.stop()


def test_unused_etcd_options_do_not_connect_at_creation(tmp_path: Path) -> None:
    # building the app against an address nobody listens on must not fail (nothing connects yet)
    settings = Settings(etcd=EtcdOptions("127.0.0.1:1"), tokens=None)
    app = create_app(settings)
    assert app.title == "etrain"


def test_job_list_pages_follow_each_other_oldest_first(api: TestClient, live_server: str) -> None:
    from service.client import ApiClient

    ids = [api.post("/v1/jobs", json={**SPEC, "name": f"p{i}"}).json()["id"] for i in range(5)]
    first = api.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["jobs"]] == ids[:2] and first["next"]
    second = api.get("/v1/jobs", params={"limit": 2, "after": first["next"]}).json()
    assert [j["id"] for j in second["jobs"]] == ids[2:4]
    last = api.get("/v1/jobs", params={"limit": 2, "after": second["next"]}).json()
    assert [j["id"] for j in last["jobs"]] == ids[4:] and last["next"] is None
    assert api.get("/v1/jobs", params={"limit": 0}).status_code == 422
    with ApiClient(live_server, token=ADMIN) as client:  # the CLI's client follows the pages
        assert [j["id"] for j in client.jobs()] == ids


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"min_nodes": 1, "max_nodes": 61}, "max_nodes", "at most 60 nodes"),
        ({"max_nodes": 30, "env": {"BLOB": "x" * 50_000}}, "env", "would exceed"),  # within the 64 KiB of a spec
    ],
)
def test_a_job_etcd_could_not_schedule_is_refused_at_submit(
    api: TestClient, change: dict[str, Any], field: str, words: str
) -> None:
    resp = api.post("/v1/jobs", json={**SPEC, **change})
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["detail"]
    assert err["loc"] == ["body", field] and words in err["msg"]
    assert api.get("/v1/jobs").json()["jobs"] == []


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("lustre:///scratch/ckpt", "mounted path"),
        ("file://otherhost/ckpt", "not host"),
    ],
)
def test_checkpoint_urls_that_no_worker_could_use_are_refused_at_submit(api: TestClient, url: str, words: str) -> None:
    resp = api.post("/v1/jobs", json={**SPEC, "checkpoint_url": url})
    assert resp.status_code == 422 and words in resp.json()["message"]


def test_spellings_of_an_active_jobs_checkpoint_prefix_are_the_same_prefix(api: TestClient, settings: Settings) -> None:
    root = str(settings.checkpoint_root)
    assert api.post("/v1/jobs", json={**SPEC, "checkpoint_url": f"{root}/a"}).status_code == 201
    for other in (f"{root}//a", f"{root}/./a", f"{root}/a/", f"{root}/a//b"):
        resp = api.post("/v1/jobs", json={**SPEC, "checkpoint_url": other})
        assert resp.status_code == 409, (other, resp.text)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (rb'{"name": "a", "entrypoint": "t.py", "env": {"X": "\ud800"}}', "env.X"),
        (rb'{"name": "a", "entrypoint": "t.py", "args": ["ok", "\udfff"]}', "args.1"),
        (rb'{"name": "a", "entrypoint": "t.py", "env": {"\ud800": "x"}}', "env"),
        (rb'{"name": "a", "entrypoint": "t\ud800.py"}', "entrypoint"),
    ],
    ids=["env-value", "args-item", "env-name", "entrypoint"],
)
def test_text_that_is_no_valid_unicode_is_422_naming_the_field_not_a_500(
    api: TestClient, body: bytes, field: str
) -> None:
    """JSON's ``\\ud800`` escapes give lone surrogates: the submit answered 500 (its size check could not serialize
    the spec, or the 422 could not quote it back). Found by fuzzing the launch path with the API's specs."""
    resp = api.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["message"].startswith(field + ":"), resp.json()
    assert api.get("/v1/jobs").json()["jobs"] == []
