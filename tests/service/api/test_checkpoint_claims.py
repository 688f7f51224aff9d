"""Which checkpoint prefix a submit may claim, through the real app on a real etcd (``--checkpoint-root`` set): not the
root itself, nor a URL that contains it (such a prefix overlaps every job's: one pending job that never starts held up
every later submit, an admin's too); and a ``user`` token's own URL not inside the default prefix ``<root>/<id>`` of
another user's job, nor of a job id that no job of its own has (the name is kept for the job that gets that id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from elastic.testing.wait import wait_for
from service.core.config import Settings
from service.core.jobs import default_prefix_job
from tests.service.conftest import ADMIN, OTHER_USER, USER

pytestmark = pytest.mark.timeout(60)

SPEC: dict[str, Any] = {"name": "train", "entrypoint": "train.py"}
NEVER_STARTS: dict[str, Any] = {"min_nodes": 60, "max_nodes": 60}  # no test cluster has 60 nodes


def _submit(api: TestClient, token: str, **spec: Any) -> Any:
    return api.post("/v1/jobs", json={**SPEC, **spec}, headers={"Authorization": f"Bearer {token}"})


def _refusal(resp: Any) -> str:
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"] == ["body", "checkpoint_url"]
    return str(error["msg"])


def test_no_job_may_claim_the_checkpoint_root_or_a_url_containing_it_so_none_blocks_every_submit(
    api: TestClient, settings: Settings
) -> None:
    root = str(settings.checkpoint_root)
    path = root.removeprefix("file://")
    for token in (USER, ADMIN):
        for url in (root, root + "/", root + "/.", path, f"{root}//", f"file://{path}/./"):
            msg = _refusal(_submit(api, token, checkpoint_url=url, **NEVER_STARTS))
            assert msg.startswith(f"is the service's checkpoint root {root}: a job's prefix must lie below it"), url
        for url in (str(Path(path).parent), "/"):
            msg = _refusal(_submit(api, token, checkpoint_url=url, **NEVER_STARTS))
            assert msg.startswith(f"contains the service's checkpoint root {root}"), url
    # nothing was stored, so every user's default prefix (and an admin's) is free
    assert api.get("/v1/jobs").json()["jobs"] == []
    for token in (USER, OTHER_USER, ADMIN):
        assert _submit(api, token, **NEVER_STARTS).status_code == 201
    assert _submit(api, USER, checkpoint_url=f"{root}/carols-runs", **NEVER_STARTS).status_code == 201


def test_a_user_may_not_claim_a_url_inside_another_users_default_prefix_even_once_that_job_ended(
    api: TestClient, settings: Settings
) -> None:
    root = str(settings.checkpoint_root)
    theirs = _submit(api, USER).json()
    job = theirs["id"]
    assert theirs["checkpoint"]["url"] == f"{root}/{job}"
    assert api.post(f"/v1/jobs/{job}/cancel", headers={"Authorization": f"Bearer {USER}"}).status_code == 202
    wait_for(lambda: api.get(f"/v1/jobs/{job}").json()["state"] == "cancelled", 20, 0.2, what="cancelled")
    # the prefix is no active job's now (no 409), but it holds carol's checkpoints: dave may not write there
    for url in (
        f"{root}/{job}",
        f"{root}/{job}/resumed",
        f"{root}//{job}/x",
        f"{root}/{job.upper()}/x",
        f"{root}/{quote(job[:3])}%{ord(job[3]):02X}{job[4:]}",
    ):
        msg = _refusal(_submit(api, OTHER_USER, checkpoint_url=url))
        assert msg.startswith(
            f"lies in {root}/{job}, the default checkpoint prefix of job {job}, and job {job} was "
            "submitted by another user"
        ), (url, msg)
    # carol may resume from her own job's checkpoints in a new job, and an admin may write anywhere below the root
    assert _submit(api, USER, checkpoint_url=f"{root}/{job}/resumed").status_code == 201
    assert _submit(api, ADMIN, checkpoint_url=f"{root}/{job}/copy").status_code == 201
    assert _submit(api, ADMIN, checkpoint_url=f"{root}/{job}/resumed/x").status_code == 409  # carol's new job's
    assert _submit(api, ADMIN, checkpoint_url=f"{root}/{job}-x").status_code == 201  # no job id: free to all


def test_a_user_may_not_claim_the_default_prefix_of_a_job_id_not_yet_created(
    api: TestClient, settings: Settings
) -> None:
    root = str(settings.checkpoint_root)
    for url in (f"{root}/train-deadbeef", f"{root}/train-deadbeef/ckpt", f"{root}/a-b-0123abcd"):
        msg = _refusal(_submit(api, USER, checkpoint_url=url))
        job = url.removeprefix(root + "/").split("/")[0]
        assert msg == (
            f"lies in {root}/{job}, the default checkpoint prefix of job {job}, and no job {job} of user "
            "carol exists, and the name is kept for the job that gets that id: below the root give a "
            "directory whose name is not a job id (<name>-<8 hex digits>)"
        )
    for name in ("train-deadbee", "train-deadbeef0", "train_deadbeef", "-deadbeef", "train-deadbeeg", "runs"):
        assert _submit(api, USER, checkpoint_url=f"{root}/{name}").status_code == 201, name
    assert _submit(api, ADMIN, checkpoint_url=f"{root}/train-deadbeef").status_code == 201  # an operator may


def test_default_prefix_job_names_the_job_id_of_the_first_segment_below_the_root() -> None:
    assert default_prefix_job("file:///ck/job-0123abcd/x", "file:///ck") == "job-0123abcd"
    assert default_prefix_job("s3://b/root/JOB-0123ABCD", "s3://b/root") == "job-0123abcd"
    assert default_prefix_job("s3://b/root//./job-0123abcd", "s3://b/root/") == "job-0123abcd"
    assert default_prefix_job("s3://b/root/job%2D0123abcd", "s3://b/root") == "job-0123abcd"
    assert default_prefix_job("s3://b/root/runs/job-0123abcd", "s3://b/root") is None  # deeper: no default prefix
    assert default_prefix_job("s3://b/root", "s3://b/root") is None
