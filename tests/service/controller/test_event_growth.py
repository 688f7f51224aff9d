"""A job cannot grow its events without bound (real controller passes on a real etcd): a rank 0 that reports the
same rejected checkpoint (a 4 KB path: an 8 KB event) on every pass leaves one event, its ``repeats`` counting the
passes and its texts clipped; a job whose reports keep changing its world size keeps only the newest
``event_limit`` events."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(120)

JOB = "growing-00000001"


@pytest.fixture
def store(etcd_client: EtcdClient, key_prefix: str) -> Iterator[ServiceStore]:
    """A running job on one node (the first pass places it)."""
    store = ServiceStore(etcd_client, key_prefix)
    lease = etcd_client.grant_lease(timedelta(seconds=120))
    now = datetime.now(timezone.utc)
    store.register_node(NodeInfo(name="n1", capacity=1, incarnation="x", registered_at=now), lease)
    spec = JobSpec(name="growing", entrypoint="t.py", min_nodes=1, max_nodes=1)
    record = JobRecord(id=JOB, spec=spec, created_at=now, checkpoint_url="file:///ck/growing")
    store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "test", now))
    yield store
    etcd_client.revoke_lease(lease)


def _report(store: ServiceStore, n: int, world_size: int = 1, path: str | None = None) -> None:
    """Rank 0's report number ``n`` (a newer time each)."""
    entry = store.get_job(JOB)
    assert entry is not None
    progress = Progress(
        step=n,
        world_size=world_size,
        time=datetime.now(timezone.utc).timestamp() + n,
        generation=entry.status.generation,
        checkpoint_step=5 if path else None,
        checkpoint_path=path,
    )
    store.client.put(store.keys.progress_of(JOB), progress.to_json())


def test_the_same_rejected_checkpoint_on_every_pass_leaves_one_event_counting_them(
    etcd_server: LocalEtcdCluster, key_prefix: str, store: ServiceStore
) -> None:
    controller = Controller(store, make_settings(etcd_server, key_prefix))
    try:
        controller.tick()
        entry = store.get_job(JOB)
        assert entry is not None and entry.status.state == JobState.RUNNING
        _report(store, 0)  # (its world size: an event of its own)
        controller.tick()
        before = len(store.events(JOB))
        path = "/elsewhere/" + "x" * 4000  # outside the job's prefix (progress reports allow 4096 characters)
        for n in range(1, 41):
            _report(store, n, path=path)
            controller.tick()
        events = store.events(JOB)
        rejected = [e for e in events if e.type == "checkpoint_rejected"]
        assert len(events) == before + 1 and len(rejected) == 1, [e.type for e in events]
        assert rejected[0].data["repeats"] == 40
        assert len(rejected[0].message) < 1100 and len(rejected[0].data["path"]) < 1100  # clipped
        entry = store.get_job(JOB)
        assert entry is not None and entry.status.step == 40  # the reports themselves were still read
    finally:
        controller.stop()


def test_a_job_keeps_only_its_newest_events(
    etcd_server: LocalEtcdCluster, key_prefix: str, store: ServiceStore
) -> None:
    settings = make_settings(etcd_server, key_prefix)
    settings = replace(settings, reconcile=replace(settings.reconcile, event_limit=20))
    controller = Controller(store, settings)
    try:
        controller.tick()
        for n in range(1, 61):  # world size 2, 1, 2, 1, ...: each report a new event
            _report(store, n, world_size=1 + n % 2)
            controller.tick()
        events = store.events(JOB)
        assert len(events) <= 22, len(events)  # the limit, and what the last pass added since the last count
        assert events[-1].type == "world_size" and events[-1].data["world_size"] == 1  # the newest are kept
        assert events[0].type == "world_size"  # the oldest (submitted, state) went first
    finally:
        controller.stop()
