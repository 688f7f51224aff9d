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

and beside it, ``<prefix>.rdzv/<job id>.g<generation>/``: the jobs' torchrun rendezvous (etcd-v3 backend), kept
out of ``<prefix>/`` so that its traffic does not wake the reconcile loop.

Controller writes are fenced: :meth:`ServiceStore.apply` commits one job's update in one transaction that also
requires the status key's revision to be unchanged and the leader key to be the caller's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError, KeyValue
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

_APPLY_THREADS = 8  # job transactions of one plan in flight at once
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
        self._pool: ThreadPoolExecutor | None = None  # apply_plan's senders, made at the first plan
        self._pool_lock = threading.Lock()

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
        (rec, st, cancel), _ = self.client.read_prefixes(
            [k.job(job_id), k.status_of(job_id), k.cancel_of(job_id)]
        )
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
        return sorted(
            self._entries(recs, sts, cancels).values(), key=lambda e: (e.record.created_at, e.record.id)
        )

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
            if (record is None or status is None or rec_kv is None or st_kv is None
                    or not at_own_key(rec_kv, record.id, job_id)):  # fmt: skip
                raise JobNotFound(job_id)
            cancelled = any(kv.key == k.cancel_of(job_id) for kv in cancels)
            resized = plan_resize(record, status, min_nodes, max_nodes, requested_by=requested_by,
                                  now=now or datetime.now(timezone.utc))  # fmt: skip
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
            n for kv in nodes
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
        """Commit one job's update if its status is unchanged and ``fence`` still holds; with ``written``, add
        to it each key put, with its value and the revision of the write as its ``mod_revision``."""
        k = self.keys
        if update.purge:
            ok, _ = self.client.commit(
                deletes=[k.job(update.job_id), k.status_of(update.job_id), k.cancel_of(update.job_id),
                         k.progress_of(update.job_id),
                         *(k.report(update.job_id, node) for node in update.clear_report_nodes)],
                delete_prefixes=[k.events_of(update.job_id), k.metrics_of(update.job_id)],
                expect=[(k.status_of(update.job_id), update.expected_revision)],
                guard=fence,
            )  # fmt: skip
            return ok
        puts: list[tuple[str, bytes]] = []
        if update.status is not None:
            puts.append((k.status_of(update.job_id), dump(update.status)))
        puts += [(k.events_of(update.job_id) + e.id, dump(e)) for e in update.events]
        stamped = {  # every node of a generation meets under the prefix the controller names
            node: a if a.rdzv_prefix else a.model_copy(update={"rdzv_prefix": k.rdzv})
            for node, a in update.assign.items()
        }
        puts += [(k.assignment(node, update.job_id), dump(a)) for node, a in stamped.items()]
        deletes = [k.assignment(node, update.job_id) for node in update.unassign]
        deletes += [k.report(update.job_id, node) for node in update.clear_report_nodes]
        ok, revision = self.client.commit(
            puts,
            deletes,
            expect=[(k.status_of(update.job_id), update.expected_revision)],
            guard=fence,
        )
        if ok and written is not None:
            written += [KeyValue(key, value, 0, revision) for key, value in puts]
        return ok

    def _apply_one(self, update: JobUpdate, fence: tuple[str, int]) -> tuple[bool, str | None, list[KeyValue]]:
        """``(applied, etcd's refusal or None, what was written)``; raises :class:`EtcdConnectionError`."""
        mine: list[KeyValue] = []
        try:
            return self.apply(update, fence, mine), None, mine
        except EtcdConnectionError:
            raise
        except EtcdError as exc:
            return False, str(exc), []

    def apply_plan(self, plan: Plan, fence: tuple[str, int], written: list[KeyValue] | None = None) -> PlanOutcome:
        """Apply every job's part of ``plan``, each in its own transaction: etcd refusing one job's part
        (too many operations, too large) is that job's failure alone. Unreachable etcd (or lost quorum)
        raises :class:`EtcdConnectionError`: nothing more can be written this pass.

        An update with ``after`` jobs (they release nodes it is assigned) is sent only once their updates were
        applied; if one of them was refused or failed it is held back (counted as refused: the next pass decides
        again), so a node is never assigned to two jobs. The jobs' transactions of one round (disjoint keys) are
        sent ``_APPLY_THREADS`` at a time: one after the other, a pass that updates a few hundred jobs spent most
        of its time waiting for each answer in turn."""
        refused = 0
        failed: dict[str, str] = {}
        done: set[str] = set()  # sent (or held back)
        applied: set[str] = set()
        held: list[str] = []
        pending = list(plan.updates)
        planned = {u.job_id for u in pending}
        while pending:
            stable = False
            while not stable:  # hold back what needs an update that was not applied, then what needs those
                stable = True
                for update in list(pending):
                    # (an ``after`` job missing from the plan had its update taken out: not applied either)
                    missing = [a for a in update.after if a not in planned or (a in done and a not in applied)]
                    if missing:
                        pending.remove(update)
                        held.append(update.job_id)
                        done.add(update.job_id)
                        stable = False
                        logger.warning("update of job %s held back: the update of job %s, which gives up nodes "
                                       "it takes, was not applied", update.job_id, ", ".join(missing))  # fmt: skip
            waiting = {u.job_id for u in pending}
            ready = [u for u in pending if not any(a in waiting and a != u.job_id for a in u.after)]
            if not ready and pending:  # a cycle: none of it can be ordered safely
                held += [u.job_id for u in pending]
                break
            for update, (ok, error, kvs) in zip(ready, self._send(ready, fence), strict=True):
                done.add(update.job_id)
                if written is not None:
                    written += kvs
                if error is not None:
                    failed[update.job_id] = error
                    logger.warning("etcd refused the update of job %s: %s", update.job_id, error)
                elif not ok:
                    refused += 1
                    logger.info("update of job %s refused (status changed or leadership lost)", update.job_id)
                else:
                    applied.add(update.job_id)
            sent = {u.job_id for u in ready}
            pending = [u for u in pending if u.job_id not in sent]
        refused += len(held)
        for node, job_id in plan.orphans:  # one by one: a bad key must not keep the others
            try:
                ok, _ = self.client.commit(deletes=[self.keys.assignment(node, job_id)], guard=fence)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                logger.warning("cannot delete the orphaned assignment %s/%s: %s", node, job_id, exc)
                continue
            refused += 0 if ok else 1
        return PlanOutcome(refused=refused, failed=failed, held=tuple(held))

    def _send(self, updates: list[JobUpdate], fence: tuple[str, int]) -> list[tuple[bool, str | None, list[KeyValue]]]:
        """Each update's ``_apply_one``, ``_APPLY_THREADS`` at a time when there are several."""
        if len(updates) <= 1:
            return [self._apply_one(u, fence) for u in updates]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_APPLY_THREADS, thread_name_prefix="etrain-apply")
            pool = self._pool
        return list(pool.map(lambda u: self._apply_one(u, fence), updates))


def identities_prefix(keys: Keys) -> str:
    """``<prefix>/identities/``: the leader's record of each job's own etcd user (its password included; see
    ``service.controller.identities``). Control-plane only: a job's user cannot read it."""
    return f"{keys.root}/identities/"


def identity_key(keys: Keys, job_id: str) -> str:
    return identities_prefix(keys) + job_id


def create_store(client: EtcdClient, prefix: str = DEFAULT_PREFIX) -> ServiceStore:
    return ServiceStore(client, prefix)
