"""ServiceStore: operators' node requests (cordon / drain / uncordon) and job resizes, on the in-memory etcd and,
for the race of a resize, on a real one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from elastic.etcd import EtcdClient, MemoryEtcdClient, MemoryEtcdServer
from service.core.jobs import InvalidResize, JobFinished
from service.core.keys import dump
from service.core.models import JobRecord, JobSpec, JobStatus, NodeControl, NodeMode
from service.core.states import JobState
from service.core.store import JobNotFound, ResizeConflict, ServiceStore, new_event

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def client() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.fixture
def store(client: MemoryEtcdClient) -> ServiceStore:
    return ServiceStore(client, "/t")


def _control(name: str, mode: NodeMode = NodeMode.CORDONED, reason: str | None = None) -> NodeControl:
    return NodeControl(name=name, mode=mode, requested_by="alice", at=T0, reason=reason)


def _create(store: ServiceStore, job_id: str, min_nodes: int = 1, max_nodes: int = 3, **spec: Any) -> None:
    spec_ = JobSpec(name="job", entrypoint="train.py", min_nodes=min_nodes, max_nodes=max_nodes, **spec)
    record = JobRecord(id=job_id, created_at=T0, spec=spec_)
    submitted = T0 - timedelta(hours=1)  # before what the tests do at T0: events sort by their time
    store.create_job(record, JobStatus(created_at=T0, updated_at=T0), new_event("submitted", "submitted", submitted))


def _spec(store: ServiceStore, job_id: str) -> JobSpec:
    entry = store.get_job(job_id)
    assert entry is not None
    return entry.record.spec


# -- node controls -------------------------------------------------------------------------------------------
def test_a_node_control_reads_back_and_uncordon_deletes_it_once(store: ServiceStore) -> None:
    assert store.node_controls() == {} and store.node_control("n1") is None
    store.set_node_control(_control("n1", reason="disk swap"))
    store.set_node_control(_control("n2", NodeMode.DRAINING))
    controls = store.node_controls()
    assert list(controls) == ["n1", "n2"]
    assert controls["n1"].mode == NodeMode.CORDONED and controls["n1"].reason == "disk swap"
    assert store.node_control("n2") == controls["n2"]
    store.set_node_control(_control("n1", NodeMode.DRAINING))  # replaces the earlier request
    assert store.node_controls()["n1"].mode == NodeMode.DRAINING
    assert store.clear_node_control("n1") is True
    assert store.clear_node_control("n1") is False  # nothing left: says so
    assert list(store.node_controls()) == ["n2"]


def test_unreadable_node_controls_and_ones_naming_another_node_are_ignored(store: ServiceStore) -> None:
    store.client.put(store.keys.nodectl_of("garbage"), b"{not json")
    store.client.put(store.keys.nodectl_of("wrong-mode"), b'{"name": "wrong-mode", "mode": "melted", "at": "2026"}')
    store.client.put(store.keys.nodectl_of("n1"), dump(_control("n2")))  # names another node than its key
    store.set_node_control(_control("n3"))
    assert list(store.node_controls()) == ["n3"]
    assert store.node_control("n1") is None and store.node_control("garbage") is None


def test_a_node_control_writes_its_job_events_in_the_same_transaction(store: ServiceStore) -> None:
    _create(store, "j-1")
    revision = store.client.ping()
    store.set_node_control(_control("n1", NodeMode.DRAINING), {"j-1": new_event("drain_requested", "moving", T0)})
    assert [e.type for e in store.events("j-1")] == ["submitted", "drain_requested"]
    kv, _ = store.client.get(store.keys.nodectl_of("n1"))
    assert kv is not None and kv.mod_revision == revision + 1  # one transaction: one revision for both


def test_the_controllers_view_holds_the_node_controls(store: ServiceStore) -> None:
    store.set_node_control(_control("n1"))
    store.set_node_control(_control("gone", NodeMode.DRAINING))  # not registered: still in the view
    store.client.put(store.keys.nodectl_of("bad"), b"[]")
    view = store.read_view()
    assert {n: c.mode for n, c in view.controls.items()} == {"n1": NodeMode.CORDONED, "gone": NodeMode.DRAINING}
    store.clear_node_control("n1")
    assert list(store.read_view().controls) == ["gone"]


# -- resize --------------------------------------------------------------------------------------------------
def test_resize_rewrites_the_spec_and_adds_a_resize_event(store: ServiceStore) -> None:
    _create(store, "j-1", 1, 3, env={"A": "1"})
    entry = store.resize_job("j-1", 2, 2, requested_by="alice", now=T0)
    assert (entry.record.spec.min_nodes, entry.record.spec.max_nodes) == (2, 2)
    spec = _spec(store, "j-1")
    assert (spec.min_nodes, spec.max_nodes, spec.env, spec.name) == (2, 2, {"A": "1"}, "job")  # the rest kept
    event = store.events("j-1")[-1]
    assert event.type == "resize" and event.message == "min_nodes 1 -> 2, max_nodes 3 -> 2 (by alice)"
    assert event.data["min_nodes"] == {"old": 1, "new": 2} and event.data["max_nodes"] == {"old": 3, "new": 2}


def test_resize_of_one_bound_keeps_the_other_and_names_only_the_change(store: ServiceStore) -> None:
    _create(store, "j-1", 1, 3)
    store.resize_job("j-1", max_nodes=5)
    assert (_spec(store, "j-1").min_nodes, _spec(store, "j-1").max_nodes) == (1, 5)
    assert store.events("j-1")[-1].message == "max_nodes 3 -> 5"
    store.resize_job("j-1", min_nodes=4)
    assert (_spec(store, "j-1").min_nodes, _spec(store, "j-1").max_nodes) == (4, 5)


def test_resize_to_the_current_sizes_writes_nothing(store: ServiceStore) -> None:
    _create(store, "j-1", 1, 3)
    revision = store.client.ping()
    entry = store.resize_job("j-1", 1, 3)
    assert entry.record.spec.max_nodes == 3 and store.client.ping() == revision
    assert [e.type for e in store.events("j-1")] == ["submitted"]


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "field"),
    [(4, None, "max_nodes"), (3, 2, "max_nodes"), (None, 61, "max_nodes"), (0, None, "min_nodes")],
    ids=["min-above-max", "max-below-min", "over-the-per-job-limit", "min-zero"],
)
def test_an_invalid_resize_names_the_field_and_writes_nothing(
    store: ServiceStore, min_nodes: int | None, max_nodes: int | None, field: str
) -> None:
    _create(store, "j-1", 1, 3)
    with pytest.raises(InvalidResize) as info:
        store.resize_job("j-1", min_nodes, max_nodes)
    assert field in [f for f, _ in info.value.problems], info.value.problems
    assert (_spec(store, "j-1").min_nodes, _spec(store, "j-1").max_nodes) == (1, 3)
    assert len(store.events("j-1")) == 1


def test_a_finished_or_unknown_job_cannot_be_resized(store: ServiceStore) -> None:
    _create(store, "j-1")
    store.client.put(
        store.keys.status_of("j-1"), dump(JobStatus(state=JobState.SUCCEEDED, created_at=T0, updated_at=T0))
    )
    with pytest.raises(JobFinished, match="already succeeded"):
        store.resize_job("j-1", max_nodes=2)
    with pytest.raises(JobNotFound):
        store.resize_job("j-1x", max_nodes=2)  # an id that extends an existing one is not that job
    store.client.put(store.keys.job("j-2"), b"{not json")
    with pytest.raises(JobNotFound):
        store.resize_job("j-2", max_nodes=2)


def _interfering(client: Any, monkeypatch: pytest.MonkeyPatch, times: int, write: Callable[[int], object]) -> list[int]:
    """The next ``times`` commits of ``client`` are each preceded by ``write(n)``: another writer's change."""
    original = client.commit
    calls: list[int] = []

    def commit(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            write(len(calls))
        return original(*args, **kwargs)

    monkeypatch.setattr(client, "commit", commit)
    return calls


def test_a_resize_racing_another_resize_reads_again_and_keeps_both(
    store: ServiceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _create(store, "j-1", 1, 3)
    other = ServiceStore(store.client, "/t")  # another writer (a second API replica) on the same etcd
    calls = _interfering(store.client, monkeypatch, 1, lambda _n: other.resize_job("j-1", max_nodes=6))
    store.resize_job("j-1", min_nodes=2)
    spec = _spec(store, "j-1")
    assert (spec.min_nodes, spec.max_nodes) == (2, 6), "the retry resized the record the other writer left"
    assert [e.message for e in store.events("j-1")[1:]] == ["max_nodes 3 -> 6", "min_nodes 1 -> 2"]
    assert len(calls) == 3  # ours (refused), the other writer's, ours again


def test_a_resize_that_keeps_losing_the_race_gives_up_without_writing(
    store: ServiceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _create(store, "j-1", 1, 3)
    record_key = store.keys.job("j-1")
    kv, _ = store.client.get(record_key)
    assert kv is not None
    _interfering(store.client, monkeypatch, 100, lambda _n: store.client.put(record_key, kv.value))  # rewritten
    with pytest.raises(ResizeConflict, match="retry"):
        store.resize_job("j-1", max_nodes=2)
    assert _spec(store, "j-1").max_nodes == 3 and len(store.events("j-1")) == 1


def test_a_resize_race_on_a_real_etcd_is_retried(
    etcd_client: EtcdClient, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ServiceStore(etcd_client, key_prefix)
    _create(store, "j-1", 2, 4)
    record_key = store.keys.job("j-1")
    kv, _ = etcd_client.get(record_key)
    assert kv is not None
    calls = _interfering(etcd_client, monkeypatch, 2, lambda _n: etcd_client.put(record_key, kv.value))
    entry = store.resize_job("j-1", min_nodes=1, max_nodes=2)
    assert len(calls) == 3  # two lost races, then the write
    assert (
        (entry.record.spec.min_nodes, entry.record.spec.max_nodes)
        == (1, 2)
        == (_spec(store, "j-1").min_nodes, _spec(store, "j-1").max_nodes)
    )
    assert [e.type for e in store.events("j-1")] == ["submitted", "resize"]
