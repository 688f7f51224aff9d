"""The controller's view of the cluster and its plan: what :func:`~service.controller.reconcile.reconcile` reads
and returns, what the store builds and applies, and the timing rules it decides by.

These types are shared by the controller, the store, the settings and the API (which shows ``JobEntry``), so they
live here, beside the models, rather than inside the reconciler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from elastic.contract.progress import Progress
from service.core.models import Assignment, Event, JobRecord, JobStatus, NodeControl, NodeInfo, WorkerReport

__all__ = [
    "ClusterView",
    "JobEntry",
    "JobUpdate",
    "Plan",
    "PlanOutcome",
    "Quotas",
    "ReconcileConfig",
    "SubmitLimits",
    "WriteFailure",
]


@dataclass(frozen=True)
class JobEntry:
    record: JobRecord
    status: JobStatus
    status_revision: int
    cancel_requested: bool = False


@dataclass(frozen=True)
class WriteFailure:
    """etcd refused to write a job's part of a plan ``count`` passes in a row (e.g. too many operations or
    too large a request for one transaction); ``message`` is etcd's answer to the last try."""

    count: int
    message: str


@dataclass(frozen=True)
class ClusterView:
    jobs: Mapping[str, JobEntry]
    nodes: Mapping[str, NodeInfo]
    assignments: Mapping[str, Mapping[str, Assignment]]  # node -> job id -> assignment
    reports: Mapping[str, Mapping[str, WorkerReport]] = field(default_factory=dict)  # job -> node -> report
    progress: Mapping[str, Progress] = field(default_factory=dict)
    revision: int = 0
    write_failures: Mapping[str, WriteFailure] = field(default_factory=dict)  # kept by the controller
    controls: Mapping[str, NodeControl] = field(default_factory=dict)  # node name -> cordon / drain request


@dataclass(frozen=True)
class SubmitLimits:
    """What a ``user`` token may submit (the quotas file's ``limits``; admin tokens have none). None: no limit."""

    max_priority: int | None = None  # the highest spec.priority it may give
    queues: frozenset[str] | None = None  # the queues its jobs may name (a job without a queue: always)
    max_pending: int | None = None  # its jobs waiting to start (state pending) at once
    max_jobs: int | None = None  # its jobs stored at once, in any state (finished ones until the retention ends)

    def over(self, fallback: SubmitLimits) -> SubmitLimits:
        """These limits, each one unset taken from ``fallback``."""
        return SubmitLimits(
            max_priority=self.max_priority if self.max_priority is not None else fallback.max_priority,
            queues=self.queues if self.queues is not None else fallback.queues,
            max_pending=self.max_pending if self.max_pending is not None else fallback.max_pending,
            max_jobs=self.max_jobs if self.max_jobs is not None else fallback.max_jobs,
        )


@dataclass(frozen=True)
class Quotas:
    """Node quotas (nodes held at once by a user's or a queue's active jobs). A job counts against its
    submitter's quota (``users``, else ``default_user``) and its spec's ``queue`` quota (``queues``); None or
    absent: no limit. A quota lowered below what is held is not enforced by shrinking: it stops new
    placements until the holdings fall below it."""

    users: Mapping[str, int] = field(default_factory=dict)
    queues: Mapping[str, int] = field(default_factory=dict)
    default_user: int | None = None
    # what ``user`` tokens may submit: per user name, each unset limit taken from ``default_limits``
    limits: Mapping[str, SubmitLimits] = field(default_factory=dict)
    default_limits: SubmitLimits = field(default_factory=SubmitLimits)

    def submit_limits(self, user: str) -> SubmitLimits:
        return self.limits.get(user, SubmitLimits()).over(self.default_limits)

    def user_limit(self, user: str | None) -> int | None:
        return self.users.get(user or "", self.default_user)

    def queue_limit(self, queue: str | None) -> int | None:
        return None if queue is None else self.queues.get(queue)


@dataclass(frozen=True)
class ReconcileConfig:
    """Timing rules of the controller (not per job)."""

    success_grace: timedelta = timedelta(seconds=30)  # after a node's success, wait this long for others
    failure_settle: timedelta = timedelta(seconds=3)  # after a failure, wait this long to see who else fails
    resume_after: timedelta = timedelta(seconds=60)  # jobs that never report progress: assume recovered
    write_failure_limit: int = 3  # a job whose update etcd refuses this many passes in a row fails
    terminal_retention: timedelta = timedelta(days=7)  # finished jobs (and their events) are then deleted
    history_limit: int = 100  # world-size changes kept per job status (the newest)
    event_limit: int = 1000  # events kept per job (the newest; the leader deletes older ones)
    quotas: Quotas = field(default_factory=Quotas)


@dataclass
class JobUpdate:
    """One job's share of a plan. ``status`` None: leave the status as it is."""

    job_id: str
    expected_revision: int
    status: JobStatus | None
    events: list[Event] = field(default_factory=list)
    assign: dict[str, Assignment] = field(default_factory=dict)
    unassign: list[str] = field(default_factory=list)
    clear_reports: bool = False  # every report of the job is deleted: clear_report_nodes names every reporting node
    clear_report_nodes: list[str] = field(default_factory=list)  # delete these nodes' reports of the job
    purge: bool = False  # delete the job with its status, events, reports and progress (retention over)
    # jobs whose updates of the same plan must be applied before this one: they give up nodes this one is assigned
    # (a preemption, a shrink, a release); if any of them is not applied this one is held back (decided again
    # next pass), so a node is never booked by two jobs
    after: list[str] = field(default_factory=list)


@dataclass
class Plan:
    updates: list[JobUpdate] = field(default_factory=list)
    orphans: list[tuple[str, str]] = field(default_factory=list)  # (node, job id) of unknown jobs

    @property
    def empty(self) -> bool:
        return not self.updates and not self.orphans


@dataclass(frozen=True)
class PlanOutcome:
    """What applying a plan did: ``refused`` updates (stale status or lost leadership: decided again next
    pass), ``failed`` ones (job id -> etcd's refusal of that job's transaction; other jobs' parts were
    still applied) and ``held`` back ones (job ids: an update one of whose ``after`` jobs' updates was not applied;
    also counted in ``refused``)."""

    refused: int = 0
    failed: Mapping[str, str] = field(default_factory=dict)
    held: tuple[str, ...] = ()
