"""Any job's rank 0 writes its progress key: whatever it holds, the controller's pass goes on for every job.

A progress value that is not a valid report (wrong types, out of range, not JSON, a checkpoint path the
controller cannot parse) is "no progress" for that job alone, with a rate-limited warning naming the job.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, MemoryEtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.controller.loop import Controller
from service.core.models import JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from tests.service.conftest import make_settings
from tests.service.controller.cluster_sim import Cluster as _Cluster
from tests.service.controller.cluster_sim import spec as _spec
from tests.service.controller.test_reconcile import _s

pytestmark = pytest.mark.timeout(120)

GARBAGE = {
    "time-is-a-word": b'{"step": 3, "world_size": 1, "time": "soon"}',
    "world-size-is-a-list": b'{"step": 3, "world_size": [1, 2], "time": 1700000000.0}',
    "time-out-of-range": b'{"step": 3, "world_size": 1, "time": 1e300}',
    "nan-time": b'{"step": 3, "world_size": 1, "time": NaN}',
    "negative-step": b'{"step": -3, "world_size": 1, "time": 1700000000.0}',
    "checkpoint-path-of-no-scheme": b'{"step": 3, "world_size": 1, "time": 1700000000.0, "checkpoint_step": 2,'
    b' "checkpoint_path": "ftp://elsewhere/x"}',
    "checkpoint-path-relative": b'{"step": 3, "world_size": 1, "time": 1700000000.0, "checkpoint_step": 2,'
    b' "checkpoint_path": "relative/x"}',
    "nodes-of-lone-surrogates": b'{"step": 3, "world_size": 2, "time": 1700000000.0, "nodes": ["\\ud800"]}',
    "deeply-nested": b'{"step": 3, "world_size": 1, "time": 1.0, "extra": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "not-an-object": b"[1, 2, 3]",
    "invalid-utf8": b'{"step": 3, "world_size": 1, "time": 1.0, "checkpoint_path": "/\xff"}',
}


def _submit(store: ServiceStore, job_id: str, at: datetime, checkpoint_url: str) -> None:
    spec = JobSpec(name=job_id.split("-")[0], entrypoint="t.py", min_nodes=1, max_nodes=1)
    record = JobRecord(id=job_id, spec=spec, created_at=at, checkpoint_url=checkpoint_url)
    store.create_job(record, JobStatus(created_at=at, updated_at=at), new_event("submitted", "test", at))


def _state(store: ServiceStore, job_id: str) -> JobStatus:
    entry = store.get_job(job_id)
    assert entry is not None
    return entry.status


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_a_job_with_garbage_progress_does_not_stop_another_jobs_cancel(
    etcd_server: LocalEtcdCluster,
    etcd_client: EtcdClient,
    key_prefix: str,
    garbage: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    lease = etcd_client.grant_lease(timedelta(seconds=60))
    now = datetime.now(timezone.utc)
    for name in ("n1", "n2"):
        store.register_node(NodeInfo(name=name, capacity=1, incarnation="x", registered_at=now), lease)
    _submit(store, "bad-1", now, "file:///ck/bad-1")  # first in the pass: its progress is read first
    _submit(store, "good-1", now + timedelta(seconds=1), "file:///ck/good-1")
    controller = Controller(store, make_settings(etcd_server, key_prefix))
    try:
        controller.tick()
        assert _state(store, "bad-1").state == JobState.RUNNING
        assert _state(store, "good-1").state == JobState.RUNNING
        etcd_client.put(store.keys.progress_of("bad-1"), garbage)  # what any job's rank 0 can do
        store.request_cancel("good-1", new_event("cancel_requested", "cancel requested", now))
        with caplog.at_level(logging.WARNING, logger="service.core.store"):
            for _ in range(3):
                assert controller.tick() is not None  # no pass raises
        good = _state(store, "good-1")
        assert good.state == JobState.CANCELLED
        _, assigned = store.list_nodes()
        assert all("good-1" not in jobs for jobs in assigned.values())  # the cancel was carried out
        assert store.progress("bad-1") is None
        bad = _state(store, "bad-1")
        assert bad.state == JobState.RUNNING and bad.step is None  # the garbage counts as no progress
        warnings = [r for r in caplog.records if r.name == "service.core.store" and r.levelno >= logging.WARNING]
        assert all("bad-1" in r.getMessage() for r in warnings)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # named, and not once per pass
        # the job's next valid report is read again
        valid = Progress(step=9, world_size=1, time=datetime.now(timezone.utc).timestamp(), generation=bad.generation)
        etcd_client.put(store.keys.progress_of("bad-1"), valid.to_json())
        controller.tick()
        assert _state(store, "bad-1").step == 9
    finally:
        controller.stop()
        etcd_client.revoke_lease(lease)


# -- property: any bytes in the progress key, then a reconcile pass over a running job ---------------------
_CHECKPOINT_PATHS = st.sampled_from(
    [
        "/ck/j1/step-5",
        "file:///ck/j1/step-5",
        "/ck/other/step-5",
        "s3://bucket/x",
        "ftp://x/y",
        "relative/x",
        "file://host/ck",
        "/ck/j1/../other",
        "s3://[bad",
        "",
        "://",
        "/",
        "\x00",
        "file:///ck/j1/\u00e9",
    ]
) | st.text(max_size=12)
_documents = st.fixed_dictionaries(
    {
        "step": st.integers(min_value=-2, max_value=2**64),
        "world_size": st.integers(min_value=-1, max_value=5) | st.text(max_size=2),
        "time": st.floats(allow_nan=True, allow_infinity=True) | st.integers(-1, 2**64) | st.just(_s(5).timestamp()),
    },
    optional={
        "generation": st.none() | st.integers(min_value=-1, max_value=3),
        "restart_count": st.integers(min_value=-1, max_value=3),
        "checkpoint_step": st.none() | st.integers(min_value=-1, max_value=10),
        "checkpoint_path": st.none() | _CHECKPOINT_PATHS,
        "nodes": st.none() | st.lists(st.sampled_from(["a", "b", "\ud800", ""]) | st.integers(), max_size=3),
        "loss": st.none() | st.floats(allow_nan=True, allow_infinity=True),
        "total_steps": st.none() | st.integers(min_value=-1, max_value=10),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_documents)
@example(
    doc={
        "step": 1,
        "world_size": 1,
        "time": _s(5).timestamp(),
        "generation": 1,
        "checkpoint_step": 1,
        "checkpoint_path": "ftp://x/y",
    }
)
@example(doc={"step": 1, "world_size": 1, "time": 1e300})
@example(doc={"step": 1, "world_size": 2, "time": _s(5).timestamp(), "generation": 1, "nodes": ["\ud800"]})
def test_a_reconcile_pass_never_raises_whatever_the_progress_key_holds(doc: dict[str, Any]) -> None:
    store = ServiceStore(MemoryEtcdClient(), "/p")
    store.client.put(store.keys.progress_of("j1"), json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass"))
    c = _Cluster()
    c.add_nodes("a", "b")
    c.add_job("j1", _spec(min_nodes=1, max_nodes=2), checkpoint_url="file:///ck/j1")
    c.tick(_s(1))
    assert c.status("j1").state == JobState.RUNNING
    p = store.progress("j1")  # what read_view() puts in the view: a valid report or none
    if p is not None:
        c.progress["j1"] = p
    c.tick(_s(6))
    c.status("j1").model_dump_json()  # the status the pass made can be written back to etcd
