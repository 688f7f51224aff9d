"""The leader's cached view (ViewCache) equals a full read after any changes: random changes to every prefix
of the view (valid records, garbage, records at another job's or node's key, deletions, leases expiring), on the
in-memory etcd and on a real one, with the watch hints on, off, and late."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, MemoryEtcdClient, MemoryEtcdServer
from service.core.models import Assignment, JobRecord, JobSpec, JobStatus, NodeControl, NodeInfo, NodeMode, WorkerReport
from service.core.states import JobState
from service.core.store import ServiceStore, new_event
from service.core.view_cache import ViewCache

pytestmark = pytest.mark.timeout(120)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOBS = [f"j{i}" for i in range(8)] + ["j1-x", "j1/x"]  # ids that extend others, one with a slash
NODES = [f"n{i}" for i in range(8)]


class Changes:
    """Random writes of every kind the view is made of."""

    def __init__(self, store: ServiceStore, seed: int) -> None:
        self.store = store
        self.k = store.keys
        self.rng = random.Random(seed)
        self.leases: list[int] = []

    def _value(self, good: bytes) -> bytes:
        roll = self.rng.random()
        if roll < 0.08:
            return b"{not json"
        if roll < 0.12:
            return b'{"state": "running"}'  # valid JSON, not a record
        return good

    def one(self) -> None:
        r, k, c = self.rng, self.k, self.store.client
        job, node = r.choice(JOBS), r.choice(NODES)
        other = r.choice(JOBS)  # a record at ``job``'s key that may name another job
        spec = JobSpec(name="job", entrypoint="train.py", min_nodes=1, max_nodes=r.randint(1, 3))
        kind = r.randrange(10)
        if kind == 0:
            rec = JobRecord(id=job if r.random() < 0.9 else other, spec=spec, created_at=T0)
            c.put(k.job(job), self._value(rec.model_dump_json().encode()))
        elif kind == 1:
            st = JobStatus(
                state=r.choice(list(JobState)),
                generation=r.randint(0, 3),
                created_at=T0,
                updated_at=T0,
                nodes=sorted(r.sample(NODES, r.randint(0, 3))),
            )
            c.put(k.status_of(job), self._value(st.model_dump_json().encode()))
        elif kind == 2:
            c.put(k.cancel_of(job), b"{}")
        elif kind == 3:
            info = NodeInfo(
                name=node if r.random() < 0.9 else "elsewhere",
                capacity=r.randint(1, 4),
                incarnation=str(r.random()),
                registered_at=T0,
            )
            lease = 0
            if r.random() < 0.5:
                lease = c.grant_lease(timedelta(seconds=30))
                self.leases.append(lease)
            c.put(k.node(node), self._value(info.model_dump_json().encode()), lease=lease)
        elif kind == 4:
            a = Assignment(
                job_id=job if r.random() < 0.9 else other, generation=r.randint(1, 3), spec=spec, assigned_at=T0
            )
            c.put(k.assignment(node, job), self._value(a.model_dump_json().encode()))
        elif kind == 5:
            rep = WorkerReport(
                job_id=job if r.random() < 0.9 else other,
                node=node,
                generation=r.randint(1, 3),
                state=r.choice(["running", "exited", "stopped"]),
                exit_code=r.choice([None, 0, 1]),
            )
            c.put(k.report(job, node), self._value(rep.model_dump_json().encode()))
        elif kind == 6:
            p = Progress(step=r.randint(0, 100), world_size=r.randint(1, 4), time=1e9 + r.random(), nodes=[node])
            c.put(k.progress_of(job), self._value(p.to_json()) if r.random() < 0.9 else b'{"step": -1}')
        elif kind == 7:  # deletions: one key, or a node's reports, or a node's lease
            choice = r.randrange(4)
            if choice == 0:
                c.delete(
                    r.choice(
                        [
                            k.job(job),
                            k.status_of(job),
                            k.cancel_of(job),
                            k.progress_of(job),
                            k.node(node),
                            k.nodectl_of(node),
                        ]
                    )
                )
            elif choice == 1:
                c.commit(delete_prefixes=[k.reports_by(node)])
            elif choice == 2:
                c.delete(k.assignment(node, job))
            elif self.leases:
                c.revoke_lease(self.leases.pop(r.randrange(len(self.leases))))
        elif kind == 8:  # an operator's cordon / drain request (uncordon: the deletions above)
            ctl = NodeControl(
                name=node if r.random() < 0.9 else "elsewhere",
                mode=r.choice(list(NodeMode)),
                at=T0,
                requested_by="op",
                reason=r.choice([None, "maintenance"]),
            )
            c.put(k.nodectl_of(node), self._value(ctl.model_dump_json().encode()))
        else:  # several prefixes in one transaction, as the leader writes
            st = JobStatus(state=JobState.RUNNING, generation=2, created_at=T0, updated_at=T0, nodes=[node])
            a = Assignment(job_id=job, generation=2, spec=spec, assigned_at=T0)
            elsewhere = r.choice([n for n in NODES if n != node])
            c.commit(
                [
                    (k.status_of(job), st.model_dump_json().encode()),
                    (k.assignment(node, job), a.model_dump_json().encode()),
                ],
                [k.assignment(elsewhere, job)] if r.random() < 0.5 else [],
            )


def _check(client: EtcdClient, store: ServiceStore, seed: int, rounds: int, watch: bool) -> dict[str, int]:
    reads = {"full": 0, "incremental": 0}

    def on_read(kind: str, _fetched: int) -> None:
        reads[kind] += 1

    cache = ViewCache(client, store.keys, watch=watch, on_read=on_read)
    changes = Changes(store, seed)
    try:
        for n in range(rounds):
            for _ in range(changes.rng.choice([0, 1, 1, 2, 5, 20])):
                changes.one()
            cached = cache.read()
            full = store.read_view()
            assert cached.revision == full.revision, f"round {n}"
            assert cached == full, f"round {n}: the cached view differs from a full read"
    finally:
        cache.close()
    return reads


@pytest.fixture
def memory() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.mark.parametrize("watch", [True, False], ids=["hints", "no-hints"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_cached_view_equals_a_full_read_after_random_changes(
    memory: MemoryEtcdClient, seed: int, watch: bool
) -> None:
    reads = _check(memory, ServiceStore(memory, "/t"), seed, 300, watch)
    assert reads["full"] == 1 and reads["incremental"] >= 299  # one full read, then only changes


def test_a_late_hint_is_caught_by_the_compares(memory: MemoryEtcdClient) -> None:
    """Hints that never arrive (a watch lagging behind): the prefix compares still see every change."""
    store = ServiceStore(memory, "/t")
    cache = ViewCache(memory, store.keys, watch=True)
    try:
        cache.read()
        assert cache._hints is not None
        cache._hints.close()
        cache._hints._latest = dict.fromkeys(cache._hints._latest, 0)  # frozen: says nothing changed
        changes = Changes(store, 9)
        for _ in range(200):
            changes.one()
            assert cache.read() == store.read_view()
    finally:
        cache.close()


def test_a_key_deleted_without_any_write_is_noticed(memory: MemoryEtcdClient) -> None:
    """A deletion leaves no mod revision behind: the count of the prefix tells, and the prefix is listed."""
    store = ServiceStore(memory, "/t")
    info = NodeInfo(name="n1", capacity=1, incarnation="i", registered_at=T0)
    lease = memory.grant_lease(timedelta(seconds=30))
    store.register_node(info, lease)
    store.register_node(info.model_copy(update={"name": "n2"}), memory.grant_lease(timedelta(seconds=30)))
    cache = ViewCache(memory, store.keys, watch=False)
    cache._hints = None
    assert set(cache.read().nodes) == {"n1", "n2"}
    memory.revoke_lease(lease)
    assert set(cache.read().nodes) == {"n2"}
    memory.delete(store.keys.node("n2"))
    assert cache.read().nodes == {}


def test_a_pass_whose_keys_change_under_it_starts_over_and_stays_exact(memory: MemoryEtcdClient) -> None:
    """Writes racing the reads (another thread): each read is a consistent revision; at the end, exact."""
    store = ServiceStore(memory, "/t")
    cache = ViewCache(memory, store.keys)
    stop = threading.Event()
    changes = Changes(store, 5)

    def write() -> None:
        while not stop.is_set():
            changes.one()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        revisions = [cache.read().revision for _ in range(200)]
    finally:
        stop.set()
        writer.join(timeout=10)
    assert revisions == sorted(revisions)
    assert cache.read() == store.read_view()
    cache.close()


def test_many_changes_at_once_are_read_whole(memory: MemoryEtcdClient) -> None:
    store = ServiceStore(memory, "/t")
    kinds: list[str] = []
    cache = ViewCache(memory, store.keys, watch=False, max_changed=10, on_read=lambda kind, _n: kinds.append(kind))
    cache.read()
    changes = Changes(store, 4)
    for _ in range(3):
        changes.one()
    cache.read()
    for _ in range(60):
        changes.one()
    assert cache.read() == store.read_view()
    assert kinds[0] == "full" and kinds[1] == "incremental" and kinds[-1] == "full"


@pytest.fixture
def real(etcd_client: EtcdClient, key_prefix: str) -> Iterator[ServiceStore]:
    yield ServiceStore(etcd_client, key_prefix)


@pytest.mark.parametrize("watch", [True, False], ids=["hints", "no-hints"])
def test_the_cached_view_equals_a_full_read_on_a_real_etcd(real: ServiceStore, watch: bool) -> None:
    reads = _check(real.client, real, 11, 120, watch)
    assert reads["full"] == 1


def test_a_listing_longer_than_one_answer_is_read_in_pages_and_the_view_still_equals_a_full_read() -> None:
    """Each pass lists the prefixes that changed (keys only). One answer held every key: past gRPC's 4 MiB (some
    70,000 jobs) every incremental pass failed, and the leader fell back to reading everything each time. Here the
    client may receive 64 KiB, and 2,000 jobs' keys take about 100 KB."""
    server = MemoryEtcdServer(max_response_bytes=64 * 1024)
    memory = server.client()
    store = ServiceStore(memory, "/t")
    now = datetime.now(timezone.utc)
    for i in range(2000):
        record = JobRecord(id=f"job-{i:04d}", spec=JobSpec(name="j", entrypoint="t.py"), created_at=now)
        store.create_job(record, JobStatus(created_at=now, updated_at=now), new_event("submitted", "s", now))
    kinds: list[str] = []
    cache = ViewCache(memory, store.keys, watch=False, list_page=500, on_read=lambda kind, _n: kinds.append(kind))
    try:
        assert len(cache.read().jobs) == 2000
        later = JobStatus(message="changed", created_at=now, updated_at=now)
        memory.put(store.keys.status_of("job-1234"), later.model_dump_json().encode())
        memory.delete(store.keys.cancel_of("nothing"))  # (no change) ...
        memory.delete(store.keys.job("job-0007"))  # ... and a deletion, which only a listing shows
        cached = cache.read()
        assert cached == store.read_view()
        assert cached.jobs["job-1234"].status.message == "changed" and "job-0007" not in cached.jobs
        assert kinds == ["full", "incremental"]  # the second read went incremental, in pages
    finally:
        cache.close()
