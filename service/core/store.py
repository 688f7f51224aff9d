"""The service's state in etcd (through ``elastic.etcd`` only): key layout, (de)serialization, writes.

Layout under the prefix (``/etrain`` by default)::

    leader                     the leader's identity, on the leader's lease (see service.controller.leader)
    jobs/<id>                  JobRecord: spec, resolved checkpoint URL (written once, by the API)
    status/<id>                JobStatus (created by the API as pending, then written by the leader only)
    cancel/<id>                a cancel request (API)
    events/<id>/<event id>     Event, ordered by id (time)
    nodes/<name>               NodeInfo, on the agent's lease
    assign/<node>/<id>         Assignment (leader)
    reports/<node>/<id>        WorkerReport (the node's agent: node first, so a node's etcd user writes one prefix)
    progress/<id>              Progress (the job's rank 0, via elastic.train.progress)
    nodectl/<name>             NodeControl: an operator's cordon / drain request (API; uncordon deletes it)
    metrics/<id>/...           the job's metric series (leader; service.core.metric_store)
    identities/<id>            the job's own etcd user (service.controller.identities)
    submitters/<user>          bumped by each submit of that user (API): a user's submits are serialized on it

and beside it, ``<prefix>.rdzv/<job id>.g<generation>/``: the jobs' torchrun rendezvous (etcd-v3 backend), kept
out of ``<prefix>/`` so that its traffic does not wake the reconcile loop.

Controller writes are fenced: :meth:`ServiceStore.apply` commits one job's update in one transaction that also
requires the status key's revision to be unchanged and the leader key to be the caller's. Those writes, a plan's
under the leader's fence, are :mod:`service.core.plan_writer`'s; this module holds the plain reads and writes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, KeyValue
from service.core.jobs import new_event, plan_resize
from service.core.keys import DEFAULT_PREFIX, Keys, at_own_key, dump, load, load_progress, on_lease, tail
from service.core.metric_store import read_series
from service.core.models import (
    Assignment,
    Event,
    JobRecord,
    JobStatus,
    NodeControl,
    NodeInfo,
    WorkerReport,
)
from service.core.plan_writer import PlanWriter
from service.core.series import MetricSeries
from service.core.view import ClusterView, JobEntry, JobUpdate, Plan, PlanOutcome
from service.core.view_state import ViewState

logger = logging.getLogger(__name__)

__all__ = [
    "JobExists",
    "JobNotFound",
    "Keys",
    "ResizeConflict",
    "ServiceStore",
    "create_store",
    "new_event",  # service.core.jobs's, here for the many writers of events that import it from the store
]

_RESIZE_TRIES = 5  # a resize whose job record changed under it reads it again this many times
_MAX_CONTROL_EVENTS = 100  # job events written with a node's control request (etcd: 128 ops per transaction)
_DELETES_PER_TXN = 100  # old events deleted per transaction (etcd: 128 ops per transaction)


class JobExists(Exception):
    """A job with this id is already stored."""


class SubmitRaced(Exception):
    """Another submit of the same user committed between this one's read and its write: read again."""


class JobNotFound(LookupError):
    """No readable job with this id."""


class ResizeConflict(Exception):
    """The job record kept changing under a resize (another writer): nothing was written."""


class ServiceStore:
    """Reads and writes the service's records; safe to share between threads."""

    def __init__(self, client: EtcdClient, prefix: str = DEFAULT_PREFIX) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.plans = PlanWriter(client, self.keys)  # the leader's fenced writes of its plans

    # -- jobs (API side) -----------------------------------------------------------------------------
    def create_job(
        self, record: JobRecord, status: JobStatus, event: Event, submitter: tuple[str, int] | None = None
    ) -> None:
        """Store a new job atomically; raises :class:`JobExists` if the id is taken. ``submitter``: ``(user, the
        revision :meth:`jobs_for_submit` returned)``: the job is stored only if no other submit of that user
        committed since that read (else :class:`SubmitRaced`), so a check made on that read (the user's pending
        jobs) still holds when the job is written."""
        k = self.keys
        puts = [
            (k.job(record.id), dump(record)),
            (k.status_of(record.id), dump(status)),
            (k.events_of(record.id) + event.id, dump(event)),
        ]
        expect = [(k.job(record.id), 0), (k.status_of(record.id), 0)]
        if submitter is not None:
            puts.append((k.submitter(submitter[0]), record.id.encode()))
            expect.append((k.submitter(submitter[0]), submitter[1]))
        ok, _ = self.client.commit(puts=puts, expect=expect)
        if not ok:
            if submitter is not None and self.client.get(k.job(record.id))[0] is None:
                raise SubmitRaced(submitter[0])
            raise JobExists(record.id)

    def jobs_for_submit(self, user: str) -> tuple[list[JobEntry], int]:
        """Every job, and the mod revision of ``user``'s submitter key (0: none yet), read at one revision: pass
        both to :meth:`create_job` to store a job only while what was checked on this read holds."""
        k = self.keys
        (recs, sts, cancels, mine), _ = self.client.read_prefixes([k.jobs, k.status, k.cancel, k.submitter(user)])
        own = next((kv.mod_revision for kv in mine if kv.key == k.submitter(user)), 0)
        entries = self._entries(recs, sts, cancels).values()
        return sorted(entries, key=lambda e: (e.record.created_at, e.record.id)), own

    def get_job(self, job_id: str) -> JobEntry | None:
        k = self.keys
        (rec, st, cancel), _ = self.client.read_prefixes([k.job(job_id), k.status_of(job_id), k.cancel_of(job_id)])
        # exact keys: a prefix read also matches longer ids, keep the exact one
        rec = [x for x in rec if x.key == k.job(job_id)]
        st = [x for x in st if x.key == k.status_of(job_id)]
        cancel = [x for x in cancel if x.key == k.cancel_of(job_id)]
        if not rec or not st:
            return None
        record, status = load(JobRecord, rec[0]), load(JobStatus, st[0])
        if record is None or status is None:
            return None
        return JobEntry(record, status, st[0].mod_revision, bool(cancel))

    def list_jobs(self) -> list[JobEntry]:
        k = self.keys
        (recs, sts, cancels), _ = self.client.read_prefixes([k.jobs, k.status, k.cancel])
        return sorted(self._entries(recs, sts, cancels).values(), key=lambda e: (e.record.created_at, e.record.id))

    def _entries(
        self, recs: Iterable[KeyValue], sts: Iterable[KeyValue], cancels: Iterable[KeyValue]
    ) -> dict[str, JobEntry]:
        k = self.keys
        statuses = {tail(kv, k.status): kv for kv in sts}
        cancelled = {tail(kv, k.cancel) for kv in cancels}
        out: dict[str, JobEntry] = {}
        for kv in recs:
            job_id = tail(kv, k.jobs)
            skv = statuses.get(job_id)
            record = load(JobRecord, kv)
            status = load(JobStatus, skv) if skv is not None else None
            if record is None or status is None or skv is None or not at_own_key(kv, record.id, job_id):
                continue
            out[job_id] = JobEntry(record, status, skv.mod_revision, job_id in cancelled)
        return out

    def request_cancel(self, job_id: str, event: Event) -> None:
        k = self.keys
        self.client.commit(
            puts=[
                (k.cancel_of(job_id), event.model_dump_json().encode()),
                (k.events_of(job_id) + event.id, dump(event)),
            ]
        )

    def add_event(self, job_id: str, event: Event) -> None:
        self.client.put(self.keys.events_of(job_id) + event.id, dump(event))

    def events(self, job_id: str, after: str | None = None, limit: int = 1000) -> list[Event]:
        prefix = self.keys.events_of(job_id)
        kvs, _ = self.client.get_prefix(prefix)
        out = [e for kv in kvs if (after is None or tail(kv, prefix) > after) and (e := load(Event, kv))]
        return out[-limit:] if after is None else out[:limit]

    def trim_events(self, job_id: str, keep: int) -> int:
        """Delete the job's oldest events beyond its newest ``keep`` (the leader bounds each job's events with it);
        returns how many were deleted. Costs one count request when there is nothing to delete."""
        prefix = self.keys.events_of(job_id)
        if self.client.count_prefix(prefix) <= keep:
            return 0
        kvs, _ = self.client.get_prefix(prefix)
        old = [kv.key for kv in kvs[: max(0, len(kvs) - keep)]]
        for i in range(0, len(old), _DELETES_PER_TXN):
            self.client.commit(deletes=old[i : i + _DELETES_PER_TXN])
        return len(old)

    def progress(self, job_id: str) -> Progress | None:
        kv, _ = self.client.get(self.keys.progress_of(job_id))
        return load_progress(kv, job_id) if kv is not None else None

    def metric_series(self, job_id: str) -> MetricSeries:
        """The job's metric series as stored (``service.core.metric_store``); empty when there is none."""
        return read_series(self.client, self.keys, job_id)

    def resize_job(
        self,
        job_id: str,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        *,
        requested_by: str | None = None,
        now: datetime | None = None,
    ) -> JobEntry:
        """Rewrite the job's spec with new ``min_nodes`` / ``max_nodes`` (None: unchanged) and add a ``resize``
        event, in one transaction that requires the job record to be the one read (a concurrent change: read
        again, at most ``_RESIZE_TRIES`` times, then :class:`ResizeConflict`); an unknown job raises
        :class:`JobNotFound`. The rules are ``service.core.jobs.plan_resize``'s: the new spec must be one a submit
        would accept (``InvalidResize``), a terminal job raises ``JobFinished``, and asking for the sizes the job
        has already writes nothing.

        The leader notices the change by comparing the record's spec with its assignments' spec."""
        k = self.keys
        for _ in range(_RESIZE_TRIES):
            (recs, sts, cancels), _ = self.client.read_prefixes(
                [k.job(job_id), k.status_of(job_id), k.cancel_of(job_id)]
            )
            rec_kv = next((kv for kv in recs if kv.key == k.job(job_id)), None)
            st_kv = next((kv for kv in sts if kv.key == k.status_of(job_id)), None)
            record = load(JobRecord, rec_kv) if rec_kv is not None else None
            status = load(JobStatus, st_kv) if st_kv is not None else None
            if (
                record is None
                or status is None
                or rec_kv is None
                or st_kv is None
                or not at_own_key(rec_kv, record.id, job_id)
            ):
                raise JobNotFound(job_id)
            cancelled = any(kv.key == k.cancel_of(job_id) for kv in cancels)
            resized = plan_resize(
                record, status, min_nodes, max_nodes, requested_by=requested_by, now=now or datetime.now(timezone.utc)
            )
            if resized is None:
                return JobEntry(record, status, st_kv.mod_revision, cancelled)
            new_record, event = resized
            ok, _ = self.client.commit(
                puts=[(k.job(job_id), dump(new_record)), (k.events_of(job_id) + event.id, dump(event))],
                expect=[(k.job(job_id), rec_kv.mod_revision)],
            )
            if ok:
                return JobEntry(new_record, status, st_kv.mod_revision, cancelled)
            logger.info("job %s: its record changed during a resize; reading it again", job_id)
        raise ResizeConflict(f"job {job_id} kept changing during the resize ({_RESIZE_TRIES} tries); retry")

    # -- nodes ---------------------------------------------------------------------------------------
    def list_nodes(self) -> tuple[list[NodeInfo], dict[str, list[str]]]:
        """Live nodes, and the job ids assigned to each node."""
        k = self.keys
        (nodes, assigns), _ = self.client.read_prefixes([k.nodes, k.assign])
        jobs: dict[str, list[str]] = {}
        for kv in assigns:
            node, _, job_id = tail(kv, k.assign).partition("/")
            jobs.setdefault(node, []).append(job_id)
        infos = [
            n
            for kv in nodes
            if (n := load(NodeInfo, kv)) is not None and at_own_key(kv, n.name, tail(kv, k.nodes)) and on_lease(kv)
        ]
        return sorted(infos, key=lambda n: n.name), jobs

    def register_node(self, info: NodeInfo, lease: int) -> None:
        self.client.put(self.keys.node(info.name), dump(info), lease=lease)

    def assignments(self, node: str) -> tuple[dict[str, Assignment], int]:
        prefix = self.keys.assignments_of(node)
        kvs, revision = self.client.get_prefix(prefix)
        out = {tail(kv, prefix): a for kv in kvs if (a := load(Assignment, kv)) is not None}
        return out, revision

    def put_report(self, report: WorkerReport) -> None:
        self.client.put(self.keys.report(report.job_id, report.node), dump(report))

    def _report_kvs(self) -> list[tuple[str, str, KeyValue]]:
        """``(node, job id, value)`` of every worker report stored (``reports/<node>/<job id>``)."""
        k = self.keys
        kvs, _ = self.client.get_prefix(k.reports)
        return [(node, job_id, kv) for kv in kvs for node, _, job_id in [tail(kv, k.reports).partition("/")] if job_id]

    def report_keys(self) -> list[tuple[str, str]]:
        """``(node, job id)`` of every worker report stored."""
        return [(node, job_id) for node, job_id, _ in self._report_kvs()]

    def reports(self, job_id: str) -> dict[str, WorkerReport]:
        """The agents' worker reports of the job by node (each node's latest: a new generation replaces it); a
        report naming another job or node than its key is ignored."""
        out: dict[str, WorkerReport] = {}
        for node, of, kv in self._report_kvs():
            if of != job_id:
                continue
            report = load(WorkerReport, kv)
            if report is not None and at_own_key(kv, report.node, node) and at_own_key(kv, report.job_id, job_id):
                out[node] = report
        return out

    # -- node controls (cordon / drain; the API writes, the leader reads them in its view) -------------
    def set_node_control(self, control: NodeControl, events: Mapping[str, Event] | None = None) -> None:
        """Store an operator's request about node ``control.name`` (replacing any earlier one), and in the
        same transaction ``events`` (job id -> event: the jobs it concerns; at most 100 are written)."""
        k = self.keys
        puts = [(k.nodectl_of(control.name), dump(control))]
        chosen = list((events or {}).items())[:_MAX_CONTROL_EVENTS]
        puts += [(k.events_of(job_id) + e.id, dump(e)) for job_id, e in chosen]
        self.client.commit(puts)

    def clear_node_control(self, name: str) -> bool:
        """Delete the request about node ``name`` (uncordon); False if there was none."""
        return self.client.delete(self.keys.nodectl_of(name))

    def node_control(self, name: str) -> NodeControl | None:
        kv, _ = self.client.get(self.keys.nodectl_of(name))
        if kv is None:
            return None
        control = load(NodeControl, kv)
        return control if control is not None and at_own_key(kv, control.name, name) else None

    def node_controls(self) -> dict[str, NodeControl]:
        """Node name -> its cordon / drain request, by name; unreadable records and records naming another
        node than their key are ignored (as in the leader's view)."""
        k = self.keys
        kvs, _ = self.client.get_prefix(k.nodectl)
        out: dict[str, NodeControl] = {}
        for kv in kvs:
            name = tail(kv, k.nodectl)
            control = load(NodeControl, kv)
            if control is not None and at_own_key(kv, control.name, name):
                out[name] = control
        return dict(sorted(out.items()))

    # -- controller ----------------------------------------------------------------------------------
    def read_view(self) -> ClusterView:
        """Everything the reconcile loop decides from, read at one revision (the leader keeps it between
        passes instead: ``service.core.view_cache``; both build it with :class:`ViewState`)."""
        lists, revision = self.client.read_prefixes(ViewState.prefixes(self.keys))
        state = ViewState(self.keys, revision)
        for kvs in lists:
            for kv in kvs:
                state.put(kv)
        return state.view()

    def apply(self, update: JobUpdate, fence: tuple[str, int], written: list[KeyValue] | None = None) -> bool:
        """:meth:`PlanWriter.apply <service.core.plan_writer.PlanWriter.apply>`: one job's update, fenced."""
        return self.plans.apply(update, fence, written)

    def apply_plan(self, plan: Plan, fence: tuple[str, int], written: list[KeyValue] | None = None) -> PlanOutcome:
        """:meth:`PlanWriter.apply_plan <service.core.plan_writer.PlanWriter.apply_plan>`: every job's part of
        ``plan``, each in its own transaction fenced by the leader's key."""
        return self.plans.apply_plan(plan, fence, written)


def identities_prefix(keys: Keys) -> str:
    """``<prefix>/identities/``: the leader's record of each job's own etcd user (its password included; see
    ``service.controller.identities``). Control-plane only: a job's user cannot read it."""
    return f"{keys.root}/identities/"


def identity_key(keys: Keys, job_id: str) -> str:
    return identities_prefix(keys) + job_id


def create_store(client: EtcdClient, prefix: str = DEFAULT_PREFIX) -> ServiceStore:
    return ServiceStore(client, prefix)
