"""Secure by default, through the real app on a real etcd: where the quotas file grants a ``user`` token nothing (no
``--quotas`` at all, a user the file does not name, a limit neither its entry nor ``limits.default`` sets) it may
submit priority 0 at most (negative priorities too) and no queue, so that it cannot preempt anyone; admin tokens keep
every priority and queue, and a quotas file grants users more."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from service.core.config import load_quotas
from service.core.jobs import UNGRANTED_LIMITS, user_submit_limits
from service.core.view import Quotas, ReconcileConfig, SubmitLimits
from tests.service.conftest import ADMIN, OTHER_USER, USER, make_settings

pytestmark = pytest.mark.timeout(60)

SPEC: dict[str, Any] = {"name": "train", "entrypoint": "train.py"}


def _submit(api: TestClient, token: str, **spec: Any) -> Any:
    return api.post("/v1/jobs", json={**SPEC, **spec}, headers={"Authorization": f"Bearer {token}"})


def test_without_a_quotas_file_a_user_token_may_not_raise_priority_above_0_nor_name_a_queue(api: TestClient) -> None:
    high = _submit(api, USER, priority=1)
    assert high.status_code == 403, high.text
    assert high.json()["detail"] == (
        "priority 1 is above the maximum of user carol (0; max_priority, the default where the quotas file's limits "
        "grant none: an operator grants more there)"
    )
    assert _submit(api, USER, priority=1000).status_code == 403
    queue = _submit(api, USER, queue="team-a")
    assert queue.status_code == 403, queue.text
    assert queue.json()["detail"] == (
        "user carol may not submit to queue team-a (its queues: none; no queue is allowed where the quotas file's "
        "limits grant none: an operator grants queues there)"
    )
    assert [_submit(api, USER, priority=p).status_code for p in (0, -1, -1000)] == [201, 201, 201]
    assert _submit(api, USER).json()["spec"]["priority"] == 0  # the spec's default passes
    # an operator keeps every priority and queue
    admin = _submit(api, ADMIN, priority=1000, queue="team-a")
    assert admin.status_code == 201, admin.text
    assert (admin.json()["spec"]["priority"], admin.json()["spec"]["queue"]) == (1000, "team-a")
    assert len(api.get("/v1/jobs").json()["jobs"]) == 5  # the four of carol's that passed, the admin's: no other


@pytest.fixture
def granted(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[TestClient]:
    """A quotas file that grants carol priority 10 and queue team-a, and names neither dave nor a default."""
    quotas_file = tmp_path / "quotas.yaml"
    quotas_file.write_text(
        yaml.safe_dump(
            {"users": {"carol": 4}, "limits": {"users": {"carol": {"max_priority": 10, "queues": ["team-a"]}}}}
        )
    )
    reconcile = ReconcileConfig(success_grace=timedelta(seconds=5), quotas=load_quotas(quotas_file))
    settings = make_settings(
        etcd_server, key_prefix, checkpoint_root=f"file://{tmp_path}/ckpt", reconcile=reconcile, run_controller=False
    )
    with TestClient(create_app(settings)) as client:
        yield client


def test_a_quotas_file_grants_a_user_more_and_users_it_does_not_name_keep_the_secure_default(
    granted: TestClient,
) -> None:
    assert _submit(granted, USER, priority=10, queue="team-a").status_code == 201  # carol: granted
    over = _submit(granted, USER, priority=11)
    assert over.json()["detail"] == "priority 11 is above the maximum of user carol (10; the quotas file's limits)"
    other = _submit(granted, USER, queue="team-b")
    assert other.json()["detail"] == "user carol may not submit to queue team-b (its queues: team-a)"
    dave = _submit(granted, OTHER_USER, priority=1)  # not named: priority 0 at most, no queue
    assert dave.status_code == 403 and "above the maximum of user dave (0; max_priority, the default" in dave.text
    assert _submit(granted, OTHER_USER, queue="team-a").status_code == 403
    assert _submit(granted, OTHER_USER, priority=-5).status_code == 201


def test_user_submit_limits_fill_what_the_file_leaves_unset_with_the_secure_default() -> None:
    assert UNGRANTED_LIMITS == SubmitLimits(max_priority=0, queues=frozenset(), max_pending=None, max_jobs=1000)
    assert user_submit_limits(Quotas(), "anyone") == UNGRANTED_LIMITS
    quotas = Quotas(
        limits={"carol": SubmitLimits(queues=frozenset({"team-a"}))}, default_limits=SubmitLimits(max_pending=3)
    )
    assert user_submit_limits(quotas, "carol") == SubmitLimits(
        max_priority=0, queues=frozenset({"team-a"}), max_pending=3, max_jobs=1000
    )
    assert user_submit_limits(quotas, "dave") == SubmitLimits(
        max_priority=0, queues=frozenset(), max_pending=3, max_jobs=1000
    )
    grant_all = Quotas(default_limits=SubmitLimits(max_priority=1000))
    assert user_submit_limits(grant_all, "dave").max_priority == 1000
