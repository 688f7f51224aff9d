"""The gRPC client under an etcd outage with many threads sharing it: every call rides out the outage until
its own ``op_timeout``; one thread's reconnect never fails another thread's call (review row 7)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from elastic.etcd import EtcdClient, EtcdConnectionError, create_client
from elastic.testing.etcd_server import LocalEtcdCluster

pytestmark = pytest.mark.timeout(90)

THREADS = 15
CALLS_PER_THREAD = 3


@dataclass
class Outcome:
    started: float
    finished: float
    error: BaseException | None


def _operations(client: EtcdClient, prefix: str, thread: int) -> list[Callable[[], object]]:
    """A mix of the client's unary calls, each going through its retry loop."""
    return [
        lambda: client.put(f"{prefix}/t{thread}", b"v"),
        lambda: client.get(f"{prefix}/t{thread}"),
        lambda: client.get_prefix(prefix),
        lambda: client.count_prefix(prefix),
        lambda: client.ping(),
    ]


def _fire(client: EtcdClient, prefix: str) -> tuple[list[Outcome], list[threading.Thread]]:
    """``THREADS`` threads, released together, each making ``CALLS_PER_THREAD`` calls one after another."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)

    def worker(n: int) -> None:
        ops = _operations(client, prefix, n)
        barrier.wait()
        for i in range(CALLS_PER_THREAD):
            started = time.monotonic()
            error: BaseException | None = None
            try:
                ops[(n + i) % len(ops)]()
            except BaseException as exc:  # recorded and asserted on
                error = exc
            with lock:
                outcomes.append(Outcome(started, time.monotonic(), error))

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(THREADS)]
    for t in threads:
        t.start()
    return outcomes, threads


def test_concurrent_calls_ride_out_an_etcd_restart_shorter_than_op_timeout(etcd_member: LocalEtcdCluster) -> None:
    client = create_client(etcd_member.config(op_timeout=6, request_timeout=2))
    try:
        client.put("/outage/warm", b"1")  # the shared channel is connected before etcd goes away
        etcd_member.stop_member(0)
        outcomes, threads = _fire(client, "/outage")
        time.sleep(2)
        etcd_member.start_member(0)
        back = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    finally:
        client.close()
    assert len(outcomes) == THREADS * CALLS_PER_THREAD
    failed = [(round(o.finished - back, 2), repr(o.error)) for o in outcomes if o.error is not None]
    assert failed == [], f"calls failed (seconds after etcd was restarted, error): {failed}"
    # the first call of every thread was in flight through the whole outage
    assert sum(o.started < back < o.finished for o in outcomes) >= THREADS


def test_with_etcd_down_each_concurrent_call_fails_with_connection_error_only_at_its_op_timeout(
    etcd_member: LocalEtcdCluster,
) -> None:
    op_timeout = 3.0
    client = create_client(etcd_member.config(op_timeout=op_timeout, request_timeout=1))
    try:
        client.put("/outage/warm", b"1")
        etcd_member.stop_member(0)
        outcomes, threads = _fire(client, "/outage")
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    finally:
        client.close()
    assert len(outcomes) == THREADS * CALLS_PER_THREAD
    wrong = [repr(o.error) for o in outcomes if not isinstance(o.error, EtcdConnectionError)]
    assert wrong == [], f"calls that did not fail with EtcdConnectionError: {wrong}"
    durations = sorted(round(o.finished - o.started, 2) for o in outcomes)
    assert durations[0] >= op_timeout - 0.1, f"some calls gave up before op_timeout: {durations}"
    # one last attempt may start just before the deadline and take up to request_timeout
    assert durations[-1] <= op_timeout + 1 + 1.5, f"some calls overran op_timeout: {durations}"


def test_a_watch_retrying_through_an_outage_keeps_its_threads_and_gives_them_all_back_when_stopped(
    etcd_member: LocalEtcdCluster,
) -> None:
    # Found running the suite in parallel: every re-opened stream left two threads blocked until the watch's
    # stop (its canceller and gRPC's reader of its requests); a watch nobody stopped, on an etcd that was gone,
    # piled up 20 threads a second until the process could start no more.
    client = create_client(etcd_member.config(op_timeout=2, request_timeout=1))
    stop = threading.Event()
    try:
        client.put("/outage/watched", b"1")
        before = threading.active_count()
        watch = threading.Thread(
            target=client.watch_revisions,
            args=("/outage/", client.ping() + 1, lambda _r: None, stop),
            kwargs={"prefix": True},
            daemon=True,
        )
        watch.start()
        time.sleep(0.5)
        etcd_member.stop_member(0)
        time.sleep(3)  # some 30 tries to re-open the stream
        during = threading.active_count()
        stop.set()
        watch.join(timeout=10)
        assert not watch.is_alive()
        assert during - before <= 4, f"{during - before} threads more while the watch retried"
        time.sleep(1.5)  # its stop forwarder notices within a second
        assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    finally:
        stop.set()
        client.close()
