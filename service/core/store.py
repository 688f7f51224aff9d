"""The service's state in etcd (through ``elastic.etcd`` only): key layout, (de)serialization, writes.

Layout under the prefix (``/etrain`` by default)::

    leader                     the leader's identity, on the leader's lease (see service.controller.leader)
    jobs/<id>                  JobRecord: spec, resolved checkpoint URL (written once, by the API)
    status/<id>                JobStatus (created by the API as pending, then written by the leader only)
    cancel/<id>                a cancel request (API)
    events/<id>/<event id>     Event, ordered by id (time)
    nodes/<name>               NodeInfo, on the agent's lease
    assign/<node>/<id>         Assignment (leader)
    reports/<id>/<node>        WorkerReport (agent)
    progress/<id>              Progress (the job's rank 0, via elastic.progress)
    identities/<id>            the job's own etcd user (service.controller.identities)

and beside it, ``<prefix>.rdzv/<job id>-g<generation>/``: the jobs' torchrun rendezvous (etcd-v3 backend), kept
out of ``<prefix>/`` so that its traffic does not wake the reconcile loop.

Controller writes are fenced: :meth:`ServiceStore.apply` commits one job's update in one transaction that also
requires the status key's revision to be unchanged and the leader key to be the caller's.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError, KeyValue
from elastic.progress import Progress
from service.core.models import (
    Assignment,
    Event,
    JobRecord,
    JobStatus,
    NodeInfo,
    WorkerReport,
    normalize_checkpoint_url,
)
from service.core.view import ClusterView, JobEntry, JobUpdate, Plan, PlanOutcome

logger = logging.getLogger(__name__)

__all__ = ["JobExists", "Keys", "ServiceStore", "create_store", "new_event"]

M = TypeVar("M", bound=BaseModel)


class JobExists(Exception):
    """A job with this id is already stored."""


class Keys:
    """Key names under one prefix."""

    def __init__(self, prefix: str) -> None:
        root = "/" + prefix.strip("/")
        self.root = root
        self.leader = f"{root}/leader"
        self.jobs = f"{root}/jobs/"
        self.status = f"{root}/status/"
        self.cancel = f"{root}/cancel/"
        self.events = f"{root}/events/"
        self.nodes = f"{root}/nodes/"
        self.assign = f"{root}/assign/"
        self.reports = f"{root}/reports/"
        self.progress = f"{root}/progress/"
        # beside the service's keys, not under them: the reconcile loop watches ``<root>/`` and torchrun's
        # rendezvous traffic (heartbeats, store keys) must not wake it; a grant on ``<root>`` covers both
        self.rdzv = f"{root}.rdzv"
        self.legacy_rdzv = f"{root}/rdzv"  # before the rendezvous moved out: assignments that name no prefix

    def job(self, job_id: str) -> str:
        return self.jobs + job_id

    def status_of(self, job_id: str) -> str:
        return self.status + job_id

    def cancel_of(self, job_id: str) -> str:
        return self.cancel + job_id

    def events_of(self, job_id: str) -> str:
        return f"{self.events}{job_id}/"

    def node(self, name: str) -> str:
        return self.nodes + name

    def assignments_of(self, node: str) -> str:
        return f"{self.assign}{node}/"

    def assignment(self, node: str, job_id: str) -> str:
        return f"{self.assign}{node}/{job_id}"

    def reports_of(self, job_id: str) -> str:
        return f"{self.reports}{job_id}/"

    def report(self, job_id: str, node: str) -> str:
        return f"{self.reports}{job_id}/{node}"

    def progress_of(self, job_id: str) -> str:
        return self.progress + job_id


def new_event(kind: str, message: str, now: datetime, **data: object) -> Event:
    """An event written outside the reconcile loop (the API): time-ordered id, random suffix."""
    return Event(
        id=f"{int(now.timestamp() * 1_000_000):017d}-a{secrets.token_hex(3)}",
        time=now,
        type=kind,
        message=message,
        data=dict(data),
    )


def _load(model: type[M], kv: KeyValue) -> M | None:
    try:
        record = model.model_validate_json(kv.value)
    except ValidationError as exc:
        logger.warning("ignoring unreadable %s at %s: %s", model.__name__, kv.key, exc.errors()[:1])
        return None
    problem = _unusable(record)
    if problem is not None:
        logger.warning("ignoring unreadable %s at %s: %s", model.__name__, kv.key, problem)
        return None
    return record


_INT64 = 1 << 63


def _unusable(record: BaseModel) -> str | None:
    """What makes a validated record unusable, or None. Every time the service writes is in UTC (one without a
    time zone cannot be compared with the controller's clock; one beyond year 1-9999 in UTC cannot be shown)
    and every integer fits 64 bits (metrics are floats; a larger one overflows). Walked without recursion:
    ``Event.data`` may nest deeply."""
    stack: list[object] = [record]
    while stack:
        value = stack.pop()
        if isinstance(value, BaseModel):
            stack.extend(value.__dict__.values())
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, datetime):
            if value.utcoffset() is None:
                return f"time {value.isoformat()} has no time zone"
            try:
                value.astimezone(timezone.utc)
            except OverflowError:
                return f"time {value.isoformat()} is out of range in UTC"
        elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
            return f"integer {str(value)[:20]}... does not fit 64 bits"
    return None


def _at_own_key(kv: KeyValue, named: str, by_key: str) -> bool:
    """Whether a record names what its key does: one under another job's (or node's) key must not act for the
    job (node) it names, e.g. a failure report under job A's key restarting job B."""
    if named == by_key:
        return True
    logger.warning("ignoring the record at %s: it names %r", kv.key, named[:100])
    return False


def _dump(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _tail(kv: KeyValue, prefix: str) -> str:
    return kv.key[len(prefix) :]


class ServiceStore:
    """Reads and writes the service's records; safe to share between threads."""

    def __init__(self, client: EtcdClient, prefix: str = "/etrain") -> None:
        self.client = client
        self.keys = Keys(prefix)

    # -- jobs (API side) -----------------------------------------------------------------------------
    def create_job(self, record: JobRecord, status: JobStatus, event: Event) -> None:
        """Store a new job atomically; raises :class:`JobExists` if the id is taken."""
        k = self.keys
        ok, _ = self.client.commit(
            puts=[
                (k.job(record.id), _dump(record)),
                (k.status_of(record.id), _dump(status)),
                (k.events_of(record.id) + event.id, _dump(event)),
            ],
            expect=[(k.job(record.id), 0), (k.status_of(record.id), 0)],
        )
        if not ok:
            raise JobExists(record.id)

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
        record, status = _load(JobRecord, rec[0]), _load(JobStatus, st[0])
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
        statuses = {_tail(kv, k.status): kv for kv in sts}
        cancelled = {_tail(kv, k.cancel) for kv in cancels}
        out: dict[str, JobEntry] = {}
        for kv in recs:
            job_id = _tail(kv, k.jobs)
            skv = statuses.get(job_id)
            record = _load(JobRecord, kv)
            status = _load(JobStatus, skv) if skv is not None else None
            if record is None or status is None or skv is None or not _at_own_key(kv, record.id, job_id):
                continue
            out[job_id] = JobEntry(record, status, skv.mod_revision, job_id in cancelled)
        return out

    def request_cancel(self, job_id: str, event: Event) -> None:
        k = self.keys
        self.client.commit(
            puts=[
                (k.cancel_of(job_id), event.model_dump_json().encode()),
                (k.events_of(job_id) + event.id, _dump(event)),
            ]
        )

    def add_event(self, job_id: str, event: Event) -> None:
        self.client.put(self.keys.events_of(job_id) + event.id, _dump(event))

    def events(self, job_id: str, after: str | None = None, limit: int = 1000) -> list[Event]:
        prefix = self.keys.events_of(job_id)
        kvs, _ = self.client.get_prefix(prefix)
        out = [e for kv in kvs if (after is None or _tail(kv, prefix) > after) and (e := _load(Event, kv))]
        return out[-limit:] if after is None else out[:limit]

    def progress(self, job_id: str) -> Progress | None:
        kv, _ = self.client.get(self.keys.progress_of(job_id))
        return _progress(kv, job_id) if kv is not None else None

    # -- nodes ---------------------------------------------------------------------------------------
    def list_nodes(self) -> tuple[list[NodeInfo], dict[str, list[str]]]:
        """Live nodes, and the job ids assigned to each node."""
        k = self.keys
        (nodes, assigns), _ = self.client.read_prefixes([k.nodes, k.assign])
        jobs: dict[str, list[str]] = {}
        for kv in assigns:
            node, _, job_id = _tail(kv, k.assign).partition("/")
            jobs.setdefault(node, []).append(job_id)
        infos = [
            n for kv in nodes if (n := _load(NodeInfo, kv)) is not None and _at_own_key(kv, n.name, _tail(kv, k.nodes))
        ]
        return sorted(infos, key=lambda n: n.name), jobs

    def register_node(self, info: NodeInfo, lease: int) -> None:
        self.client.put(self.keys.node(info.name), _dump(info), lease=lease)

    def assignments(self, node: str) -> tuple[dict[str, Assignment], int]:
        prefix = self.keys.assignments_of(node)
        kvs, revision = self.client.get_prefix(prefix)
        out = {_tail(kv, prefix): a for kv in kvs if (a := _load(Assignment, kv)) is not None}
        return out, revision

    def put_report(self, report: WorkerReport) -> None:
        self.client.put(self.keys.report(report.job_id, report.node), _dump(report))

    # -- controller ----------------------------------------------------------------------------------
    def read_view(self) -> ClusterView:
        """Everything the reconcile loop decides from, read at one revision."""
        k = self.keys
        (recs, sts, cancels, nodes, assigns, reports, progress), revision = self.client.read_prefixes(
            [k.jobs, k.status, k.cancel, k.nodes, k.assign, k.reports, k.progress]
        )
        assignments: dict[str, dict[str, Assignment]] = {}
        for kv in assigns:
            node, _, job_id = _tail(kv, k.assign).partition("/")
            a = _load(Assignment, kv)
            if a is not None and _at_own_key(kv, a.job_id, job_id):
                assignments.setdefault(node, {})[job_id] = a
        by_job: dict[str, dict[str, WorkerReport]] = {}
        for kv in reports:
            r = _load(WorkerReport, kv)
            if r is not None and _at_own_key(kv, f"{r.job_id}/{r.node}", _tail(kv, k.reports)):
                by_job.setdefault(r.job_id, {})[r.node] = r
        prog = {job: p for kv in progress if (p := _progress(kv, job := _tail(kv, k.progress))) is not None}
        live = {n.name: n for kv in nodes if (n := _load(NodeInfo, kv)) and _at_own_key(kv, n.name, _tail(kv, k.nodes))}
        return ClusterView(
            jobs=self._entries(recs, sts, cancels),
            nodes=live,
            assignments=assignments,
            reports=by_job,
            progress=prog,
            revision=revision,
        )

    def apply(self, update: JobUpdate, fence: tuple[str, int]) -> bool:
        """Commit one job's update if its status is unchanged and ``fence`` still holds."""
        k = self.keys
        if update.purge:
            ok, _ = self.client.commit(
                deletes=[k.job(update.job_id), k.status_of(update.job_id), k.cancel_of(update.job_id),
                         k.progress_of(update.job_id)],
                delete_prefixes=[k.events_of(update.job_id), k.reports_of(update.job_id)],
                expect=[(k.status_of(update.job_id), update.expected_revision)],
                guard=fence,
            )  # fmt: skip
            return ok
        puts: list[tuple[str, bytes]] = []
        if update.status is not None:
            puts.append((k.status_of(update.job_id), _dump(update.status)))
        puts += [(k.events_of(update.job_id) + e.id, _dump(e)) for e in update.events]
        stamped = {  # every node of a generation meets under the prefix the controller names
            node: a if a.rdzv_prefix else a.model_copy(update={"rdzv_prefix": k.rdzv})
            for node, a in update.assign.items()
        }
        puts += [(k.assignment(node, update.job_id), _dump(a)) for node, a in stamped.items()]
        deletes = [k.assignment(node, update.job_id) for node in update.unassign]
        ok, _ = self.client.commit(
            puts,
            deletes,
            delete_prefixes=[k.reports_of(update.job_id)] if update.clear_reports else [],
            expect=[(k.status_of(update.job_id), update.expected_revision)],
            guard=fence,
        )
        return ok

    def apply_plan(self, plan: Plan, fence: tuple[str, int]) -> PlanOutcome:
        """Apply every job's part of ``plan``, each in its own transaction: etcd refusing one job's part
        (too many operations, too large) is that job's failure alone. Unreachable etcd (or lost quorum)
        raises :class:`EtcdConnectionError`: nothing more can be written this pass."""
        refused = 0
        failed: dict[str, str] = {}
        for update in plan.updates:
            try:
                ok = self.apply(update, fence)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                failed[update.job_id] = str(exc)
                logger.warning("etcd refused the update of job %s: %s", update.job_id, exc)
                continue
            if not ok:
                refused += 1
                logger.info("update of job %s refused (status changed or leadership lost)", update.job_id)
        for node, job_id in plan.orphans:  # one by one: a bad key must not keep the others
            try:
                ok, _ = self.client.commit(deletes=[self.keys.assignment(node, job_id)], guard=fence)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                logger.warning("cannot delete the orphaned assignment %s/%s: %s", node, job_id, exc)
                continue
            refused += 0 if ok else 1
        return PlanOutcome(refused=refused, failed=failed)


#: a job's unreadable progress is warned about at most once per this many seconds (the pass reads it each tick)
_BAD_PROGRESS_WARN_EVERY = 60.0
_bad_progress_warned: dict[str, float] = {}  # progress key -> time.monotonic() of its last warning
_bad_progress_lock = threading.Lock()


def _progress(kv: KeyValue, job_id: str) -> Progress | None:
    """The job's progress report, or None when the value is not a valid one: anything at all may be there
    (any job's rank 0 writes its key), and it must be that job's problem alone, never the reconcile pass's.
    Besides :meth:`Progress.from_json`'s checks, the checkpoint path must parse as the controller reads it."""
    try:
        progress = Progress.from_json(kv.value)
        path = progress.checkpoint_path
        if path:
            normalize_checkpoint_url(path if "://" in path else f"file://{path}")
    except ValueError as exc:  # InvalidProgressError, or the checkpoint URL's
        _warn_bad_progress(job_id, kv, exc)
        return None
    return progress


def _warn_bad_progress(job_id: str, kv: KeyValue, exc: ValueError) -> None:
    now = time.monotonic()
    with _bad_progress_lock:
        last = _bad_progress_warned.get(kv.key)
        if last is not None and now - last < _BAD_PROGRESS_WARN_EVERY:
            return
        if len(_bad_progress_warned) >= 10_000:  # bounded: forget jobs not warned about lately
            for old in [k for k, t in _bad_progress_warned.items() if now - t >= _BAD_PROGRESS_WARN_EVERY]:
                del _bad_progress_warned[old]
        _bad_progress_warned[kv.key] = now
    logger.warning(
        "job %s: ignoring its invalid progress report at %s (revision %d), as if it reported none: %s "
        "(not repeated for %.0fs)", job_id, kv.key, kv.mod_revision, str(exc)[:300], _BAD_PROGRESS_WARN_EVERY,
    )  # fmt: skip


def identities_prefix(keys: Keys) -> str:
    """``<prefix>/identities/``: the leader's record of each job's own etcd user (its password included; see
    ``service.controller.identities``). Control-plane only: a job's user cannot read it."""
    return f"{keys.root}/identities/"


def identity_key(keys: Keys, job_id: str) -> str:
    return identities_prefix(keys) + job_id


def create_store(client: EtcdClient, prefix: str = "/etrain") -> ServiceStore:
    return ServiceStore(client, prefix)
