"""The leader's cached view across leadership changes and failed passes (in-memory etcd, manual clock): a new
leader, or a leader again after a pause, reads everything once and then only changes; a pass that fails reads
everything next time; the decisions are those a full read gives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from elastic.etcd import EtcdConnectionError, EtcdError, ManualClock, MemoryEtcdClient, MemoryEtcdServer
from service.controller import loop
from service.controller.loop import Controller
from service.controller.reconcile import reconcile
from service.core.config import EtcdOptions, Settings
from service.core.models import JobRecord, JobSpec, JobStatus, NodeInfo
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view_cache import ViewCache

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
READS: list[tuple[str, str]] = []  # (replica, "full" | "incremental")


class _RecordingCache(ViewCache):
    replica = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        name = _RecordingCache.replica
        super().__init__(*args, watch=False, on_read=lambda kind, _n: READS.append((name, kind)))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    READS.clear()
    monkeypatch.setattr(loop, "ViewCache", _RecordingCache)
    yield


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> MemoryEtcdServer:
    return MemoryEtcdServer(clock)


def _controller(server: MemoryEtcdServer, name: str) -> tuple[Controller, ServiceStore, MemoryEtcdClient]:
    client = server.client()
    store = ServiceStore(client, "/t")
    settings = Settings(etcd=EtcdOptions("127.0.0.1:1"), prefix="/t", replica_id=name, leader_ttl=timedelta(seconds=2))
    return Controller(store, settings), store, client


def _tick(c: Controller, name: str) -> int | None:
    _RecordingCache.replica = name
    return c.tick(T0 + timedelta(seconds=10))


def _tick_past_lost_lease(c: Controller, name: str) -> int | None:
    """A tick, once the replica's lease keeper has replaced a lease that ran out (the clock jumped)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _tick(c, name)
        except EtcdError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _reads(name: str) -> list[str]:
    return [kind for who, kind in READS if who == name]


def _submit(store: ServiceStore, job_id: str, nodes: int = 1) -> None:
    spec = JobSpec(name="job", entrypoint="train.py", min_nodes=nodes, max_nodes=nodes)
    store.create_job(
        JobRecord(id=job_id, spec=spec, created_at=T0),
        JobStatus(created_at=T0, updated_at=T0),
        new_event("submitted", "submitted", T0),
    )


def _node(store: ServiceStore, name: str) -> None:
    lease = store.client.grant_lease(timedelta(seconds=300))  # as an agent registers: a record on none is no node
    store.register_node(NodeInfo(name=name, capacity=1, incarnation="i", registered_at=T0), lease)


def test_a_leader_reads_everything_once_then_only_changes(server: MemoryEtcdServer) -> None:
    a, store, _ = _controller(server, "a")
    _node(store, "n1")
    _submit(store, "j1")
    assert _tick(a, "a") is not None
    assert store.get_job("j1").status.state == JobState.RUNNING  # type: ignore[union-attr]
    _node(store, "n2")
    _submit(store, "j2")
    _tick(a, "a")
    _tick(a, "a")
    assert store.get_job("j2").status.state == JobState.RUNNING  # type: ignore[union-attr]
    assert _reads("a") == ["full", "incremental", "incremental"]
    a.stop()


def test_a_new_leader_and_a_returning_one_read_everything_again(server: MemoryEtcdServer, clock: ManualClock) -> None:
    a, _, client_a = _controller(server, "a")
    b, _, _ = _controller(server, "b")
    store = ServiceStore(server.client(), "/t")  # the API's and the agents' writes
    _node(store, "n1")
    _tick(a, "a")
    assert _tick(b, "b") is None  # a leads
    client_a.set_reachable(False)  # a is cut off; its lease runs out
    clock.advance(5)
    assert _tick_past_lost_lease(b, "b") is not None
    _submit(store, "j1")
    _tick(b, "b")
    assert store.get_job("j1").status.state == JobState.RUNNING  # type: ignore[union-attr]
    b.stop(resign=True)  # b hands over; a comes back with the view it had before
    client_a.set_reachable(True)
    _node(store, "n2")
    _submit(store, "j2")
    _tick_past_lost_lease(a, "a")
    _tick(a, "a")
    assert store.get_job("j2").status.state == JobState.RUNNING  # type: ignore[union-attr]
    assert store.get_job("j1").status.nodes == ["n1"]  # type: ignore[union-attr]  # a saw b's decisions
    assert _reads("b") == ["full", "incremental"]
    assert _reads("a")[0] == "full" and _reads("a")[-2:] == ["full", "incremental"]
    a.stop()


def test_a_failed_pass_makes_the_next_one_read_everything(
    server: MemoryEtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, store, _ = _controller(server, "a")
    _node(store, "n1")
    _tick(a, "a")
    _tick(a, "a")

    def broken(*_args: object, **_kwargs: object) -> object:
        raise EtcdConnectionError("etcd went away mid-pass")

    _submit(store, "j1")
    with monkeypatch.context() as m:
        m.setattr(store, "apply_plan", broken)
        with pytest.raises(EtcdConnectionError):
            _tick(a, "a")
    _tick(a, "a")
    assert _reads("a") == ["full", "incremental", "incremental", "full"]
    assert store.get_job("j1").status.state == JobState.RUNNING  # type: ignore[union-attr]
    a.stop()


def test_the_plan_from_the_cached_view_is_the_plan_from_a_full_read(server: MemoryEtcdServer) -> None:
    a, store, _ = _controller(server, "a")
    for i in range(6):
        _node(store, f"n{i}")
    for i in range(4):
        _submit(store, f"j{i}", nodes=2)
    cache = ViewCache(store.client, store.keys, watch=False)
    now = T0 + timedelta(seconds=10)
    for step in range(5):
        _tick(a, "a")
        if step == 2:
            server.client().delete(store.keys.node("n0"))
        assert reconcile(cache.read(), now) == reconcile(store.read_view(), now)
    a.stop()
