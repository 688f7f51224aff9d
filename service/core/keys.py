"""Key names of the service's state in etcd, and reading its records back: parsed, checked, never trusted.

Anything may be stored under the prefix (agents, jobs' rank 0 and operators write there), so every record is
validated (:func:`load`), a record that names another key's job or node is ignored (:func:`at_own_key`),
and a job's progress report that is not a valid one is that job's problem alone (:func:`load_progress`).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from datetime import datetime, timezone
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from elastic.contract.progress import Progress
from elastic.etcd import KeyValue
from service.core.models import normalize_checkpoint_url

logger = logging.getLogger("service.core.store")  # the records' warnings, under the store's name as before

__all__ = ["DEFAULT_PREFIX", "Keys", "at_own_key", "dump", "load", "load_progress", "on_lease", "tail"]

#: The etcd prefix of the service's state unless configured otherwise (controller, agents, CLI alike).
DEFAULT_PREFIX = "/etrain"

M = TypeVar("M", bound=BaseModel)


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
        self.nodectl = f"{root}/nodectl/"
        self.metrics = f"{root}/metrics/"  # each job's metric series (service.core.metric_store)
        self.submitters = f"{root}/submitters/"  # one key per user that submitted: serializes its submits
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

    def reports_by(self, node: str) -> str:
        """Every report of one node's agent: a prefix of the node's own (its etcd user may write there alone)."""
        return f"{self.reports}{node}/"

    def report(self, job_id: str, node: str) -> str:
        return f"{self.reports}{node}/{job_id}"

    def submitter(self, user: str) -> str:
        """The key a user's submits bump (names are quoted: a user name may hold any character)."""
        return self.submitters + urllib.parse.quote(user, safe="")

    def progress_of(self, job_id: str) -> str:
        return self.progress + job_id

    def nodectl_of(self, name: str) -> str:
        return self.nodectl + name

    def metrics_of(self, job_id: str) -> str:
        """The job's metric series: ``windows`` (its downsampled past) and ``points/<chunk>`` (the newest)."""
        return f"{self.metrics}{job_id}/"

    def metrics_windows(self, job_id: str) -> str:
        return f"{self.metrics}{job_id}/windows"

    def metrics_chunk(self, job_id: str, chunk: int) -> str:
        return f"{self.metrics}{job_id}/points/{chunk:012d}"


def load(model: type[M], kv: KeyValue) -> M | None:
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


def at_own_key(kv: KeyValue, named: str, by_key: str) -> bool:
    """Whether a record names what its key does: one under another job's (or node's) key must not act for the
    job (node) it names, e.g. a failure report under job A's key restarting job B."""
    if named == by_key:
        return True
    logger.warning("ignoring the record at %s: it names %r", kv.key, named[:100])
    return False


def on_lease(kv: KeyValue) -> bool:
    """Whether a node record lives on a lease, as an agent writes it: only a lease says the node is alive (it goes
    when the agent stops renewing it), so a record without one (written by hand, or by anyone who may write
    ``nodes/``) is no node and draws no job."""
    if kv.lease:
        return True
    logger.warning("ignoring the node record at %s: it is on no lease (agents register on theirs)", kv.key)
    return False


def dump(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def tail(kv: KeyValue, prefix: str) -> str:
    return kv.key[len(prefix) :]


#: a job's unreadable progress is warned about at most once per this many seconds (the pass reads it each tick)
_BAD_PROGRESS_WARN_EVERY = 60.0
_bad_progress_warned: dict[str, float] = {}  # progress key -> time.monotonic() of its last warning
_bad_progress_lock = threading.Lock()


def load_progress(kv: KeyValue, job_id: str) -> Progress | None:
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
        "(not repeated for %.0fs)",
        job_id,
        kv.key,
        kv.mod_revision,
        str(exc)[:300],
        _BAD_PROGRESS_WARN_EVERY,
    )
