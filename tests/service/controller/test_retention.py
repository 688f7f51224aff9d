"""Bounded state on a real etcd: a finished job is deleted, with everything kept for it, after the retention."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus, WorkerReport
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import ReconcileConfig
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(60)


def test_a_finished_job_is_deleted_with_its_events_reports_progress_and_metric_series_after_the_retention(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    now = datetime.now(timezone.utc)
    for job_id in ("old-1", "live-1"):
        rec = JobRecord(id=job_id, spec=JobSpec(name="j", entrypoint="t.py", min_nodes=2, max_nodes=2), created_at=now)
        store.create_job(rec, JobStatus(created_at=now, updated_at=now), new_event("submitted", "t", now))
    store.request_cancel("old-1", new_event("cancel_requested", "t", now))
    store.put_report(WorkerReport(job_id="old-1", node="n", generation=1, state="stopped"))
    etcd_client.put(store.keys.progress_of("old-1"), b'{"step": 1, "world_size": 1, "time": 0}')
    cfg = ReconcileConfig(terminal_retention=timedelta(seconds=1))
    controller = Controller(store, make_settings(etcd_server, key_prefix, reconcile=cfg))
    try:
        controller.tick()
        old = store.get_job("old-1")
        assert old is not None and old.status.state == JobState.CANCELLED
        assert store.metric_series("old-1").count == 1  # its report, in its series
        controller.tick(now + timedelta(seconds=0.5))
        assert store.get_job("old-1") is not None  # within the retention
        controller.tick(datetime.now(timezone.utc) + timedelta(seconds=2))
        assert store.get_job("old-1") is None
        for prefix in (
            store.keys.events_of("old-1"),
            store.keys.report("old-1", "n"),
            store.keys.progress_of("old-1"),
            store.keys.cancel_of("old-1"),
            store.keys.metrics_of("old-1"),
        ):
            assert etcd_client.count_prefix(prefix) == 0, prefix
        live = store.get_job("live-1")
        assert live is not None and live.status.state == JobState.PENDING and store.events("live-1")
    finally:
        controller.stop()
