"""No amount of stored state takes the control plane down: reads go in pages, a spec is capped, retention runs
even while the reconcile pass fails, and ``/readyz`` says when the passes keep failing.

Before: once ``jobs/`` passed 4 MiB (five ~1 MB specs, or 1,882 jobs of ~1 KB submitted and cancelled), every
read of it failed (``RESOURCE_EXHAUSTED ... larger than max``): ``GET /v1/jobs`` and every submit answered 503, the
reconcile pass failed for ever (and with it the retention that would have shrunk the store), and ``/readyz`` said
ready.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from elastic.etcd import EtcdClient, MemoryEtcdServer
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_until
from service.api.app import create_app
from service.controller.loop import FAILING_AFTER, Controller
from service.core.config import EtcdOptions, Settings
from service.core.models import JobRecord, JobSpec, JobStatus, WorkerReport
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import ReconcileConfig
from tests.service.conftest import ADMIN, make_settings

pytestmark = pytest.mark.timeout(120)

SPEC = {"name": "small", "entrypoint": "train.py"}


def _store_jobs(
    store: ServiceStore, n: int, pad: int, *, state: JobState = JobState.CANCELLED, finished: datetime | None = None
) -> None:
    """``n`` jobs of about ``pad`` bytes each, stored as a submit of before the spec cap would have."""
    now = datetime.now(timezone.utc)
    for i in range(n):
        rec = JobRecord(
            id=f"old-{i:05d}", spec=JobSpec(name="old", entrypoint="t.py", env={"PAD": "x" * pad}), created_at=now
        )
        status = JobStatus(state=state, created_at=now, updated_at=finished or now, finished_at=finished)
        store.create_job(rec, status, new_event("submitted", "t", now))


def test_jobs_beyond_a_grpc_answer_are_listed_a_submit_is_stored_and_the_pass_reconciles(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    _store_jobs(store, 300, 16 * 1024)  # 4.9 MiB of job records
    settings = make_settings(etcd_server, key_prefix)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {ADMIN}"}) as api:
        listed = api.get("/v1/jobs", params={"limit": 1000})
        assert listed.status_code == 200, listed.text[:300]
        assert len(listed.json()["jobs"]) == 300
        made = api.post("/v1/jobs", json=SPEC)
        assert made.status_code == 201, made.text[:300]
        controller: Controller = api.app.state.controller  # type: ignore[attr-defined]
        assert wait_until(lambda: controller.health.seconds_since_success is not None, timeout=30)
        assert controller.health.consecutive_failures == 0
        ready = api.get("/readyz")
        assert ready.status_code == 200 and ready.json()["reconcile"] == "ok", ready.text


def test_while_every_pass_fails_readyz_says_so_and_finished_jobs_are_still_deleted_after_the_retention() -> None:
    """A progress report larger than a whole answer (here: an in-memory etcd whose client receives at most 64 KiB)
    makes every read of the leader's view fail, however small its pages: the passes fail, ``/readyz`` answers
    503 naming the failure, and the jobs finished longer ago than the retention are deleted all the same."""
    server = MemoryEtcdServer(max_response_bytes=64 * 1024)
    client = server.client()
    prefix = "/growth"
    store = ServiceStore(client, prefix)
    long_ago = datetime.now(timezone.utc) - timedelta(days=30)
    _store_jobs(store, 5, 100, finished=long_ago)
    client.put(store.keys.progress_of("live-1"), b'{"step": 1, "pad": "' + b"x" * 100_000 + b'"}')
    store.put_report(WorkerReport(job_id="old-00001", node="n1", generation=1, state="exited", exit_code=0))
    settings = Settings(
        etcd=EtcdOptions("127.0.0.1:9"),
        prefix=prefix,
        tokens=None,
        leader_ttl=timedelta(seconds=2),
        reconcile_interval=timedelta(seconds=0.2),
        reconcile=ReconcileConfig(terminal_retention=timedelta(days=7)),
    )
    with TestClient(create_app(settings, client)) as api:
        controller: Controller = api.app.state.controller  # type: ignore[attr-defined]
        assert wait_until(lambda: controller.health.consecutive_failures >= FAILING_AFTER, timeout=30)
        ready = api.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["ready"] is False and "failing" in ready.json()["reconcile"]
        assert "larger than max" in ready.json()["reconcile"]
        assert wait_until(lambda: store.client.count_prefix(store.keys.jobs) == 0, timeout=30), "not deleted"
        assert store.client.count_prefix(store.keys.reports) == 0  # with what their nodes reported
        assert controller.health.failing  # still: the progress report is there
