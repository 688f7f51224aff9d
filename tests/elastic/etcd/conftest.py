"""The clusters the EtcdClient contract runs on: a real etcd (gRPC client) and the in-memory model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from elastic.etcd import EtcdAuth, EtcdClient, ManualClock, MemoryEtcdServer, auth_of, create_client
from elastic.testing.etcd_server import LocalEtcdCluster, find_etcd_binary


@dataclass
class Cluster:
    """One cluster under test: clients of it, and a way to let lease time pass (real time for a real etcd,
    a :class:`ManualClock` for the memory model)."""

    kind: str
    make_client: Callable[[], EtcdClient]
    advance: Callable[[float], None]
    clients: list[EtcdClient] = field(default_factory=list)

    def new_client(self) -> EtcdClient:
        client = self.make_client()
        self.clients.append(client)
        return client


@pytest.fixture(params=["grpc", "memory"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The real half needs an etcd binary (and is skipped without one); the memory half never starts one."""
    if request.param == "grpc":
        try:
            find_etcd_binary()
        except FileNotFoundError as exc:
            pytest.skip(f"real half needs etcd: {exc}")
        server: LocalEtcdCluster = request.getfixturevalue("etcd_server")
        made = Cluster("grpc", lambda: create_client(server.config(op_timeout=5)), time.sleep)
    else:
        clock = ManualClock()
        memory = MemoryEtcdServer(clock)
        made = Cluster("memory", memory.client, clock.advance)
    yield made
    for client in made.clients:
        client.close()


@pytest.fixture
def client(cluster: Cluster) -> EtcdClient:
    return cluster.new_client()


@pytest.fixture
def auth(client: EtcdClient) -> EtcdAuth:
    """The users and roles of ``client`` (the same client: both implementations are an EtcdAuth too)."""
    return auth_of(client)


def later(seconds: float, action: Callable[[], object]) -> threading.Timer:
    """Run ``action`` in ``seconds`` on a timer thread."""
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


class Revisions:
    """An ``on_revision`` callback that remembers what it was given."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.cond = threading.Condition()

    def __call__(self, revision: int) -> None:
        with self.cond:
            self.seen.append(revision)
            self.cond.notify_all()

    def wait_for(self, revision: int, timeout: float = 20) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: bool(self.seen) and self.seen[-1] >= revision, timeout)


def watch_in_thread(
    client: EtcdClient, key: str, start: int, prefix: bool
) -> tuple[Revisions, threading.Event, threading.Thread]:
    """``client.watch_revisions`` running in a daemon thread: what it saw, its stop event, the thread."""
    seen, stop = Revisions(), threading.Event()
    thread = threading.Thread(
        target=client.watch_revisions, args=(key, start, seen, stop), kwargs={"prefix": prefix}, daemon=True
    )
    thread.start()
    return seen, stop, thread
