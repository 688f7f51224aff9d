"""Roles and owners through the real app on a real etcd: ``user`` tokens act on their own jobs only, ``read``
tokens see status without env values, args or logs, and the quotas file's limits bound what users submit."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_for
from service.api.app import create_app
from service.core.config import load_quotas
from service.core.view import ReconcileConfig
from tests.service.conftest import ADMIN, OTHER_USER, READER, USER, make_settings

pytestmark = pytest.mark.timeout(60)

SPEC: dict[str, Any] = {
    "name": "train",
    "entrypoint": "train.py",
    "args": ["--lr", "0.1"],
    "env": {"WANDB_API_KEY": "s3cr3t"},
}


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[TestClient]:
    """The app (no agents: jobs stay pending), with limits for carol (USER) and defaults for other users."""
    quotas_file = tmp_path / "quotas.yaml"
    quotas_file.write_text(
        yaml.safe_dump(
            {
                "limits": {
                    "default": {"max_priority": 0},
                    "users": {
                        "carol": {"max_priority": 10, "queues": ["team-a"], "max_pending": 2},
                        "dave": {"max_jobs": 3},
                    },
                }
            }
        )
    )
    reconcile = ReconcileConfig(success_grace=timedelta(seconds=5), quotas=load_quotas(quotas_file))
    settings = make_settings(etcd_server, key_prefix, checkpoint_root=f"file://{tmp_path}/ckpt", reconcile=reconcile)
    with TestClient(create_app(settings)) as client:
        yield client


def _submit(api: TestClient, token: str, **spec: Any) -> Any:
    return api.post("/v1/jobs", json={**SPEC, **spec}, headers=_as(token))


def test_a_user_cannot_cancel_or_resize_another_users_job_but_can_its_own(api: TestClient) -> None:
    resp = _submit(api, USER)
    assert resp.status_code == 201 and resp.json()["submitted_by"] == "carol"  # the job's owner: the token's user
    job = resp.json()["id"]
    for method, path, body in (
        ("POST", f"/v1/jobs/{job}/cancel", None),
        ("PATCH", f"/v1/jobs/{job}", {"max_nodes": 2}),
    ):
        other = api.request(method, path, json=body, headers=_as(OTHER_USER))
        assert other.status_code == 403, other.text
        assert "token 'dave' (role user) may not" in other.json()["detail"]
        assert "it belongs to carol, and only its owner or an admin token may" in other.json()["detail"]
    logs = api.get(f"/v1/jobs/{job}/logs", headers=_as(OTHER_USER))
    assert logs.status_code == 403 and "may not read the logs of job" in logs.json()["detail"]
    assert api.get(f"/v1/jobs/{job}/logs", headers=_as(USER)).status_code == 404  # its own: allowed (none yet)
    assert api.patch(f"/v1/jobs/{job}", json={"max_nodes": 2}, headers=_as(USER)).json()["spec"]["max_nodes"] == 2
    assert api.post(f"/v1/jobs/{job}/cancel", headers=_as(USER)).status_code == 202
    theirs = _submit(api, OTHER_USER).json()["id"]
    assert api.post(f"/v1/jobs/{theirs}/cancel", headers=_as(ADMIN)).status_code == 202  # an operator: any job


def test_a_read_token_sees_status_without_env_values_args_or_logs_and_cannot_submit(api: TestClient) -> None:
    job = _submit(api, USER).json()["id"]
    for token in (READER, OTHER_USER):  # a read token, and a user who does not own the job
        seen = api.get(f"/v1/jobs/{job}", headers=_as(token)).json()
        assert seen["state"] == "pending" and seen["submitted_by"] == "carol"
        assert seen["spec"]["env"] == {"WANDB_API_KEY": "<redacted>"} and seen["spec"]["args"] == ["<redacted>"] * 2
    own = api.get(f"/v1/jobs/{job}", headers=_as(USER)).json()
    assert own["spec"]["env"] == {"WANDB_API_KEY": "s3cr3t"} and own["spec"]["args"] == ["--lr", "0.1"]
    logs = api.get(f"/v1/jobs/{job}/logs", headers=_as(READER))
    assert logs.status_code == 403 and "is read-only" in logs.json()["detail"]
    submit = _submit(api, READER)
    assert submit.status_code == 403 and submit.json()["detail"] == "token 'bob' is read-only: this needs a user token"
    drain = api.post("/v1/nodes/n1/drain", headers=_as(USER))
    assert drain.status_code == 403
    assert drain.json()["detail"] == "token 'carol' has role user: this needs an admin token"


def test_priority_above_the_users_maximum_and_a_queue_it_may_not_use_are_refused_at_submit(api: TestClient) -> None:
    high = _submit(api, USER, priority=11)
    assert high.status_code == 403
    assert high.json()["detail"] == "priority 11 is above the maximum of user carol (10; the quotas file's limits)"
    assert _submit(api, USER, priority=10, queue="team-a").status_code == 201
    queue = _submit(api, USER, queue="team-b")
    assert queue.status_code == 403
    assert queue.json()["detail"] == "user carol may not submit to queue team-b (its queues: team-a)"
    default = _submit(api, OTHER_USER, priority=1)  # dave: the default limits (max_priority 0)
    assert default.status_code == 403 and "above the maximum of user dave (0" in default.json()["detail"]
    assert _submit(api, ADMIN, priority=1000).status_code == 201  # an operator: no limits


def test_a_users_pending_jobs_are_capped_and_another_user_is_not_held_by_it(api: TestClient) -> None:
    assert [_submit(api, USER).status_code for _ in range(2)] == [201, 201]
    third = _submit(api, USER)
    assert third.status_code == 429
    assert third.json()["detail"].startswith("user carol has 2 pending job(s), its most (max_pending 2)")
    assert _submit(api, OTHER_USER).status_code == 201
    first = api.get("/v1/jobs", headers=_as(USER)).json()["jobs"][0]["id"]
    assert api.post(f"/v1/jobs/{first}/cancel", headers=_as(USER)).status_code == 202
    # a cancelled job stops counting once the leader has ended it
    wait_for(lambda: _submit(api, USER).status_code == 201, 20, 0.2, what="room for one more pending job")


def test_concurrent_submits_of_one_user_never_exceed_its_pending_cap(api: TestClient) -> None:
    """Twelve submits of carol (max_pending 2) at once: each checks its cap on a read that the write requires to
    be current (a submit another one overtook checks again), so exactly two are stored."""
    with ThreadPoolExecutor(12) as pool:
        codes = sorted(pool.map(lambda _: _submit(api, USER).status_code, range(12)))
    assert codes == [201, 201] + [429] * 10
    assert len(api.get("/v1/jobs", headers=_as(USER)).json()["jobs"]) == 2


def test_a_users_stored_jobs_are_capped_cancelled_ones_included_and_another_user_is_not_held_by_it(
    api: TestClient,
) -> None:
    """Before, ``max_pending`` counted pending jobs only: submit-then-cancel stored any number of specs (each kept for
    the retention) until etcd's reads of ``jobs/`` failed for everyone (H2)."""
    for _ in range(3):
        made = _submit(api, OTHER_USER)
        assert made.status_code == 201, made.text
        assert api.post(f"/v1/jobs/{made.json()['id']}/cancel", headers=_as(OTHER_USER)).status_code == 202
    fourth = _submit(api, OTHER_USER)
    assert fourth.status_code == 429
    assert fourth.json()["detail"].startswith("user dave has 3 job(s) stored, its most (max_jobs 3)")
    assert _submit(api, USER).status_code == 201  # carol: the default's 1000
    assert _submit(api, ADMIN).status_code == 201  # an operator: no limits
