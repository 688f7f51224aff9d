"""An in-memory stand-in for what the store does with a plan (status replaced, assignments written and deleted),
so multi-step scenarios of the pure reconciler run tick by tick without etcd."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic.contract.progress import Progress
from service.controller.reconcile import reconcile
from service.core.models import Assignment, JobRecord, JobSpec, JobStatus, NodeControl, NodeInfo, WorkerReport
from service.core.view import ClusterView, JobEntry, Plan, ReconcileConfig

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
    """Jobs, nodes, assignments, reports and progress, updated by applying plans like the store does."""

    jobs: dict[str, JobEntry] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)
    reports: dict[str, dict[str, WorkerReport]] = field(default_factory=dict)
    progress: dict[str, Progress] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    controls: dict[str, NodeControl] = field(default_factory=dict)
    cfg: ReconcileConfig = CFG

    def add_job(
        self, job_id: str, spec: JobSpec, at: datetime = T0, checkpoint_url: str | None = None,
        user: str | None = None,
    ) -> None:
        rec = JobRecord(id=job_id, spec=spec, created_at=at, checkpoint_url=checkpoint_url, submitted_by=user)
        self.jobs[job_id] = JobEntry(rec, JobStatus(created_at=at, updated_at=at), 1)

    def add_nodes(self, *names: str, capacity: int = 1) -> None:
        for n in names:
            self.nodes[n] = node(n, capacity)

    def view(self) -> ClusterView:
        return ClusterView(self.jobs, self.nodes, self.assignments, self.reports, self.progress,
                           controls=self.controls)

    def tick(self, now: datetime) -> Plan:
        plan = reconcile(self.view(), now, self.cfg)
        for u in plan.updates:
            e = self.jobs[u.job_id]
            assert u.expected_revision == e.status_revision
            if u.purge:
                del self.jobs[u.job_id]
                self.reports.pop(u.job_id, None)
                self.progress.pop(u.job_id, None)
                continue
            if u.status is not None:
                self.jobs[u.job_id] = JobEntry(e.record, u.status, e.status_revision + 1, e.cancel_requested)
            for node, a in u.assign.items():
                self.assignments.setdefault(node, {})[u.job_id] = a
            for node in u.unassign:
                self.assignments.get(node, {}).pop(u.job_id, None)
            if u.clear_reports:
                self.reports.pop(u.job_id, None)
            for node in u.clear_report_nodes:
                self.reports.get(u.job_id, {}).pop(node, None)
            self.events += [(u.job_id, ev.type) for ev in u.events]
        for node, job_id in plan.orphans:
            self.assignments[node].pop(job_id)
        return plan

    def status(self, job_id: str) -> JobStatus:
        return self.jobs[job_id].status

    def assigned(self, job_id: str) -> dict[str, int]:
        return {n: jobs[job_id].generation for n, jobs in self.assignments.items() if job_id in jobs}

    def report(self, job_id: str, node: str, state: str, code: int | None = None, at: datetime = T0,
               planned: bool = False) -> None:  # fmt: skip
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
        self.progress[job_id] = Progress(
            step=step, world_size=world, time=at.timestamp(), generation=gen, **kw
        )
