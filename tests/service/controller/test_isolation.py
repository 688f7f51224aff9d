"""One job's bad input never stops the others: each job's part of a plan is its own transaction, on a real etcd."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(120)


def _submit(store: ServiceStore, job_id: str, spec: JobSpec, at: datetime) -> None:
    record = JobRecord(id=job_id, spec=spec, created_at=at)
    store.create_job(record, JobStatus(created_at=at, updated_at=at), new_event("submitted", "test", at))


def test_a_job_whose_transaction_etcd_refuses_fails_alone_and_a_later_job_still_starts(
    etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str
) -> None:
    # 130 assignments + status + events exceed etcd's 128 operations per transaction (a spec stored before
    # submit-time limits existed, or written by hand: the controller must cope either way)
    store = ServiceStore(etcd_client, key_prefix)
    lease = etcd_client.grant_lease(timedelta(seconds=60))
    now = datetime.now(timezone.utc)
    for i in range(131):
        info = NodeInfo(name=f"n{i:03d}", capacity=1, incarnation="x", registered_at=now)
        store.register_node(info, lease)
    big = JobSpec.model_construct(
        **{**JobSpec(name="big", entrypoint="t.py").__dict__, "min_nodes": 130, "max_nodes": 130}
    )
    _submit(store, "big-1", big, now)
    _submit(store, "small-1", JobSpec(name="small", entrypoint="t.py"), now + timedelta(seconds=1))
    controller = Controller(store, make_settings(etcd_server, key_prefix))
    try:
        for _ in range(3):  # the default write_failure_limit
            assert controller.tick() is not None  # no pass raises
        small = store.get_job("small-1")
        assert small is not None and small.status.state == JobState.RUNNING and len(small.status.nodes) == 1
        controller.tick()
        failed = store.get_job("big-1")
        assert failed is not None and failed.status.state == JobState.FAILED
        assert "etcd refused this job's updates 3 times" in failed.status.message
        assert "too many operations" in failed.status.message
    finally:
        controller.stop()
        etcd_client.revoke_lease(lease)
