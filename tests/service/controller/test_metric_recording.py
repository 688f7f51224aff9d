"""The leader records the jobs' metric series (real etcd): pending reports are written when it stops, and the
next leader continues the series where its predecessor left it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus
from service.core.store import ServiceStore, new_event
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(60)


def _job(store: ServiceStore, job_id: str) -> None:
    now = datetime.now(timezone.utc)
    rec = JobRecord(id=job_id, spec=JobSpec(name="j", entrypoint="t.py"), created_at=now)
    store.create_job(rec, JobStatus(created_at=now, updated_at=now), new_event("submitted", "t", now))


def _report(client: EtcdClient, store: ServiceStore, job_id: str, step: int, t: float) -> None:
    client.put(store.keys.progress_of(job_id), Progress(step=step, world_size=2, time=t, generation=1).to_json())


def test_a_stopping_leader_writes_its_pending_reports_and_the_next_leader_continues_the_series(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    _job(store, "run-1")
    slow = make_settings(etcd_server, key_prefix, metrics_flush_interval=timedelta(hours=1))
    first = Controller(store, slow)
    try:
        _report(etcd_client, store, "run-1", 0, 1000.0)
        first.tick()  # the first write goes out at once
        _report(etcd_client, store, "run-1", 50, 1010.0)
        first.tick()  # batched: not written yet
        assert store.metric_series("run-1").count == 1
    finally:
        first.stop()  # writes what is pending, then resigns
    assert [p.step for p in store.metric_series("run-1").points] == [0, 50]

    second = Controller(store, slow)
    try:
        _report(etcd_client, store, "run-1", 150, 1020.0)
        second.tick()  # a new leader: reads the series back, appends
    finally:
        second.stop()
    points = store.metric_series("run-1").points
    assert [p.step for p in points] == [0, 50, 150]
    assert points[2].steps_per_s == pytest.approx(10.0)  # from its predecessor's last point
