"""The jobs' metric series in etcd (service.core.metric_store): written batched by the leader, bounded in bytes,
read back as written, untouched by malformed reports, deleted with the job."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, MemoryEtcdServer
from service.core.metric_store import MetricsRecorder, read_series
from service.core.models import JobRecord, JobSpec, JobStatus
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view import JobUpdate

pytestmark = pytest.mark.timeout(120)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
#: the bound docs/service.md and service/core/metric_store.py state: bytes of one job's series in etcd
DOCUMENTED_BOUND = 260_000


def _create(store: ServiceStore, job_id: str) -> None:
    record = JobRecord(id=job_id, spec=JobSpec(name="job", entrypoint="train.py"), created_at=T0)
    store.create_job(record, JobStatus(created_at=T0, updated_at=T0), new_event("submitted", "submitted", T0))


def _fence(store: ServiceStore) -> tuple[str, int]:
    return store.keys.leader, store.client.put(store.keys.leader, b"leader")


def _stored_bytes(store: ServiceStore, job_id: str) -> int:
    kvs, _ = store.client.get_prefix(store.keys.metrics_of(job_id))
    return sum(len(kv.key) + len(kv.value) for kv in kvs)


def _report(i: int, rng: random.Random) -> bytes:
    """A report with every field the series keeps, at full float precision (the worst case for its size)."""
    return Progress(
        step=1_000_000 + i * 10,
        world_size=64,
        time=1_764_000_000.123456 + i * 1.000001,
        loss=rng.random() * 3,
        generation=12,
        restart_count=3,
        checkpoint_step=1_000_000 + i,
        total_steps=10_000_000,
        extra={"snapshots_saved": 1000 + i},
    ).to_json()


def test_a_long_jobs_series_stays_within_the_documented_bytes_in_etcd_and_reads_back_as_kept() -> None:
    store = ServiceStore(MemoryEtcdServer().client(), "/t")
    _create(store, "long-1")
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys)
    rng = random.Random(7)
    most = 0
    for i in range(20_000):  # far past the point where the windows start merging (~3,000 reports)
        store.client.put(store.keys.progress_of("long-1"), _report(i, rng))
        assert recorder.observe(store.read_view()) == 1
        if i % 7 == 0:
            recorder.flush(fence, force=True)
            most = max(most, _stored_bytes(store, "long-1"))
    recorder.flush(fence, force=True)
    assert most <= DOCUMENTED_BOUND
    kept = recorder.series("long-1")
    assert kept is not None and kept.count == 20_000
    back = read_series(store.client, store.keys, "long-1")
    assert (back.first_index, back.windows, back.points) == (kept.first_index, kept.windows, kept.points)
    assert sum(w.n for w in back.windows) + len(back.points) == 20_000


def test_only_the_open_chunk_is_rewritten_per_flush_until_a_chunk_is_folded() -> None:
    store = ServiceStore(MemoryEtcdServer().client(), "/t")
    _create(store, "j-1")
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys)
    rng = random.Random(1)
    for i in range(59):
        store.client.put(store.keys.progress_of("j-1"), _report(i, rng))
        recorder.observe(store.read_view())
    recorder.flush(fence, force=True)
    kvs, _ = store.client.get_prefix(store.keys.metrics_of("j-1"))
    assert [kv.key for kv in kvs] == [store.keys.metrics_chunk("j-1", 0)]
    revs = {kv.key: kv.mod_revision for kv in kvs}
    for i in range(59, 61):
        store.client.put(store.keys.progress_of("j-1"), _report(i, rng))
        recorder.observe(store.read_view())
    recorder.flush(fence, force=True)
    kvs, _ = store.client.get_prefix(store.keys.metrics_of("j-1"))
    assert [kv.key for kv in kvs] == [store.keys.metrics_chunk("j-1", 0), store.keys.metrics_chunk("j-1", 1)]
    assert kvs[0].mod_revision > revs[kvs[0].key]  # its last point


def test_flushes_are_batched_at_most_once_per_interval() -> None:
    now = [0.0]
    store = ServiceStore(MemoryEtcdServer().client(), "/t")
    _create(store, "j-1")
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys, flush_every=5.0, clock=lambda: now[0])
    rng = random.Random(2)
    writes = 0
    for i in range(20):  # a report a second for 20 s
        store.client.put(store.keys.progress_of("j-1"), _report(i, rng))
        recorder.observe(store.read_view())
        writes += recorder.flush(fence)
        now[0] += 1.0
    assert writes == 4
    assert len(read_series(store.client, store.keys, "j-1").points) >= 16


def test_a_malformed_report_never_enters_the_series_and_another_jobs_report_still_does(
    etcd_client: EtcdClient, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    _create(store, "bad-1")
    _create(store, "good-1")
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys)
    rng = random.Random(3)
    store.client.put(store.keys.progress_of("good-1"), _report(0, rng))
    for bad in (
        b"{not json",
        b'{"step": -1, "world_size": 1, "time": 5.0}',
        b'{"step": 1, "world_size": 0, "time": 5}',
        b'{"step": 1, "world_size": 1, "time": 5, "loss": "nan"}',
        b"[1, 2]",
    ):
        store.client.put(store.keys.progress_of("bad-1"), bad)
        recorder.observe(store.read_view())
    recorder.flush(fence, force=True)
    assert read_series(store.client, store.keys, "bad-1").count == 0
    assert [p.step for p in read_series(store.client, store.keys, "good-1").points] == [1_000_000]
    assert "job bad-1: ignoring its invalid progress report" in caplog.text
    # a valid report of the same job enters afterwards
    store.client.put(store.keys.progress_of("bad-1"), _report(5, rng))
    recorder.observe(store.read_view())
    recorder.flush(fence, force=True)
    assert [p.step for p in read_series(store.client, store.keys, "bad-1").points] == [1_000_050]


def test_an_unreadable_stored_chunk_is_skipped_with_a_warning(
    etcd_client: EtcdClient, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    store.client.put(store.keys.metrics_chunk("j-1", 0), b'[{"t": "soon"}]')
    store.client.put(store.keys.metrics_chunk("j-1", 1), b'[{"t": 100.0, "step": 60, "world_size": 2}]')
    series = read_series(store.client, store.keys, "j-1")
    assert [p.step for p in series.points] == [60]
    assert "job j-1: ignoring its unreadable metric series value" in caplog.text


def test_the_series_is_deleted_with_the_job(etcd_client: EtcdClient, key_prefix: str) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    _create(store, "gone-1")
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys)
    store.client.put(store.keys.progress_of("gone-1"), _report(0, random.Random(4)))
    recorder.observe(store.read_view())
    recorder.flush(fence, force=True)
    assert store.metric_series("gone-1").count == 1
    entry = store.get_job("gone-1")
    assert entry is not None
    assert store.apply(JobUpdate("gone-1", entry.status_revision, None, purge=True), fence)
    assert store.client.get_prefix(store.keys.metrics_of("gone-1"))[0] == []
    recorder.observe(store.read_view())  # the job is gone from the view: the recorder forgets it
    assert recorder.series("gone-1") is None


def test_a_finished_jobs_last_report_is_written_then_its_series_leaves_memory() -> None:
    store = ServiceStore(MemoryEtcdServer().client(), "/t")
    record = JobRecord(id="done-1", spec=JobSpec(name="job", entrypoint="train.py"), created_at=T0)
    status = JobStatus(state=JobState.SUCCEEDED, created_at=T0, updated_at=T0)
    store.create_job(record, status, new_event("submitted", "submitted", T0))
    fence = _fence(store)
    recorder = MetricsRecorder(store.client, store.keys)
    store.client.put(store.keys.progress_of("done-1"), _report(0, random.Random(5)))
    assert recorder.observe(store.read_view()) == 1
    recorder.flush(fence, force=True)
    assert recorder.series("done-1") is None and store.metric_series("done-1").count == 1
    assert recorder.observe(store.read_view()) == 0  # the same report: not read again, not added again
    assert recorder.series("done-1") is None
