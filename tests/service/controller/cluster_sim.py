"""Multi-step scenarios of the pure reconciler, tick by tick, over the real :class:`ServiceStore` on the verified
in-memory etcd (``elastic.etcd.memory``): each tick writes what the test changed in the cluster's maps, reads the
view as the leader does (its :class:`ViewCache`, given the leader's own writes), decides (``reconcile``), applies
the plan with ``apply_plan`` under a leader's fence, and reads the maps back from etcd."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic.contract.progress import Progress
from elastic.etcd.memory import ManualClock, MemoryEtcdClient, MemoryEtcdServer
from service.controller.reconcile import reconcile
from service.core.keys import dump
from service.core.models import Assignment, JobRecord, JobSpec, JobStatus, NodeControl, NodeInfo, WorkerReport
from service.core.store import ServiceStore
from service.core.view import ClusterView, JobEntry, Plan, ReconcileConfig
from service.core.view_state import ViewState

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
CFG = ReconcileConfig(
    success_grace=timedelta(seconds=10),
    failure_settle=timedelta(seconds=2),
    resume_after=timedelta(seconds=30),
)


def spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "j", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 3}
    base.update(kw)
    return JobSpec.model_validate(base)


def node(name: str, capacity: int = 1) -> NodeInfo:
    return NodeInfo(name=name, capacity=capacity, incarnation="x", registered_at=T0)


@dataclass
class Cluster:
    """Jobs, nodes, assignments, reports, progress and node controls, as the leader's view has them after each
    tick; a test changes them in place (a node gone, a report, a cancel request) and the next tick writes that to
    etcd before it reads the view."""

    jobs: dict[str, JobEntry] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)
    reports: dict[str, dict[str, WorkerReport]] = field(default_factory=dict)
    progress: dict[str, Progress] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    controls: dict[str, NodeControl] = field(default_factory=dict)
    cfg: ReconcileConfig = CFG
    client: MemoryEtcdClient = field(init=False, repr=False)
    store: ServiceStore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # leases never expire: the clock only moves when told (the nodes' registrations live as long as the test)
        self.client = MemoryEtcdServer(ManualClock()).client()
        self.store = ServiceStore(self.client, "/sim")
        self._lease = self.client.grant_lease(timedelta(hours=1))
        leader = self.store.keys.leader
        self.fence = (leader, self.client.put(leader, b"sim"))  # (key, create revision): the leader's fence
        self._state = ViewState(self.store.keys)  # the view as ServiceStore.read_view builds it, kept between reads
        self._seen = self._view()  # what etcd holds: the view the maps were last read from

    def add_job(
        self,
        job_id: str,
        spec: JobSpec,
        at: datetime = T0,
        checkpoint_url: str | None = None,
        user: str | None = None,
    ) -> None:
        rec = JobRecord(id=job_id, spec=spec, created_at=at, checkpoint_url=checkpoint_url, submitted_by=user)
        self.jobs[job_id] = JobEntry(rec, JobStatus(created_at=at, updated_at=at), 1)

    def add_nodes(self, *names: str, capacity: int = 1) -> None:
        for n in names:
            self.nodes[n] = node(n, capacity)

    def view(self) -> ClusterView:
        return ClusterView(self.jobs, self.nodes, self.assignments, self.reports, self.progress, controls=self.controls)

    def tick(self, now: datetime) -> Plan:
        """One leader pass at ``now``: what the test changed is written, the view read, the plan applied (every
        job's update must be: the statuses it expects are the ones read), the maps read back."""
        self._write()
        plan = reconcile(self._view(), now, self.cfg)
        outcome = self.store.apply_plan(plan, self.fence)
        assert outcome.refused == 0 and not outcome.failed and not outcome.held, outcome
        self.events += [(u.job_id, ev.type) for u in plan.updates for ev in u.events]
        # kept here, and deleted from etcd (the leader bounds them too: trim_events): the in-memory etcd reads a
        # range by looking at every key, and a scenario's events would slow each tick down
        self.client.commit(delete_prefixes=[self.store.keys.events])
        self._read()
        return plan

    def _view(self) -> ClusterView:
        """:meth:`ServiceStore.read_view`'s view (one read of the view's prefixes, each key put in a
        :class:`ViewState`), where a key read before with the same mod revision is not parsed again."""
        state = self._state
        lists, state.revision = self.client.read_prefixes(ViewState.prefixes(self.store.keys))
        for prefix, kvs in zip(ViewState.prefixes(self.store.keys), lists, strict=True):
            mods = dict(state.mods(prefix))
            for kv in kvs:
                if mods.pop(kv.key, None) != kv.mod_revision:
                    state.put(kv)
            for key in mods:  # gone
                state.delete(key)
        return state.view()

    def _read(self) -> None:
        view = self._seen = self._view()
        self.jobs = dict(view.jobs)
        self.nodes = dict(view.nodes)
        self.assignments = {n: dict(jobs) for n, jobs in view.assignments.items()}
        self.reports = {j: dict(nodes) for j, nodes in view.reports.items()}
        self.progress = dict(view.progress)
        self.controls = dict(view.controls)

    def _write(self) -> None:
        """Put (or delete) in etcd what differs between the maps and the view they were read from."""
        k = self.store.keys
        stored = self._seen
        puts: list[tuple[str, bytes]] = []
        deletes: list[str] = []

        def sync(want: Mapping[str, Any], have: Mapping[str, Any], key: Any, value: Any = dump) -> None:
            puts.extend((key(name), value(v)) for name, v in want.items() if have.get(name) != v)
            deletes.extend(key(name) for name in have if name not in want)

        sync({j: e.record for j, e in self.jobs.items()}, {j: e.record for j, e in stored.jobs.items()}, k.job)
        sync({j: e.status for j, e in self.jobs.items()}, {j: e.status for j, e in stored.jobs.items()}, k.status_of)
        sync(
            {j: True for j, e in self.jobs.items() if e.cancel_requested},
            {j: True for j, e in stored.jobs.items() if e.cancel_requested},
            k.cancel_of,
            lambda _: b"{}",
        )
        sync(self.progress, stored.progress, k.progress_of, lambda p: p.to_json())
        sync(self.controls, stored.controls, k.nodectl_of)
        for node in {*self.assignments, *stored.assignments}:
            sync(
                self.assignments.get(node, {}),
                stored.assignments.get(node, {}),
                lambda job_id, node=node: k.assignment(node, job_id),
            )
        for job_id in {*self.reports, *stored.reports}:
            sync(
                self.reports.get(job_id, {}),
                stored.reports.get(job_id, {}),
                lambda node, job_id=job_id: k.report(job_id, node),
            )
        nodes = [(k.node(n), info) for n, info in self.nodes.items() if stored.nodes.get(n) != info]
        deletes += [k.node(n) for n in stored.nodes if n not in self.nodes]
        for i in range(0, max(len(puts), len(deletes)), 60):  # etcd: 128 operations per transaction
            assert self.client.commit(puts[i : i + 60], deletes[i : i + 60])[0]
        for key, info in nodes:
            self.client.put(key, dump(info), lease=self._lease)  # a node lives on its agent's lease

    def status(self, job_id: str) -> JobStatus:
        return self.jobs[job_id].status

    def assigned(self, job_id: str) -> dict[str, int]:
        return {n: jobs[job_id].generation for n, jobs in self.assignments.items() if job_id in jobs}

    def report(
        self, job_id: str, node: str, state: str, code: int | None = None, at: datetime = T0, planned: bool = False
    ) -> None:
        gen = self.status(job_id).generation
        self.reports.setdefault(job_id, {})[node] = WorkerReport(
            job_id=job_id,
            node=node,
            generation=gen,
            state=state,  # type: ignore[arg-type]
            exit_code=code,
            finished_at=at,
            planned=planned,
        )

    def progress_at(self, job_id: str, at: datetime, step: int, world: int, **kw: Any) -> None:
        gen = self.status(job_id).generation
        self.progress[job_id] = Progress(step=step, world_size=world, time=at.timestamp(), generation=gen, **kw)
