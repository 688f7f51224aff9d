"""The job rules: what a submit or a resize may ask, and who holds a checkpoint prefix. Pure decisions over
the records the store reads (``service.core.store`` only persists them; the API and the controller call these).

- submit: :func:`resolve_checkpoint_url` (the job's prefix strictly below the service's root),
  :func:`check_user_checkpoint_url` (a user's own URL is in no other job's default prefix),
  :func:`checkpoint_prefix_conflict` (an active job already holds it), :func:`new_job` (the records to store);
  the spec's own limits are ``service.core.models.submit_problems``.
- resize: :func:`plan_resize` (the new record and its ``resize`` event, or nothing to write), raising
  :class:`JobFinished` or :class:`InvalidResize`; :func:`resized_spec` validates the new spec as a submit would.
- who may submit what: :func:`submit_refusal` (a ``user`` token's limits, :func:`user_submit_limits`: priority,
  queues, pending jobs; what the quotas file does not grant, :data:`UNGRANTED_LIMITS`: priority <= 0, no queue).
- checkpoint-prefix ownership: :func:`checkpoint_claims`, the one rule of which jobs hold their prefix, used by
  the submit (:func:`checkpoint_prefix_conflict`) and the reconcile loop (``started_only``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from service.core.models import (
    NAME_PATTERN,
    Event,
    JobRecord,
    JobSpec,
    JobStatus,
    checkpoint_prefix_owner,
    checkpoint_url_within,
    normalize_checkpoint_url,
    submit_problems,
)
from service.core.states import JobState
from service.core.view import JobEntry, Quotas, SubmitLimits

__all__ = [
    "UNGRANTED_LIMITS",
    "CheckpointOutsideRoot",
    "CheckpointUrlRefused",
    "InvalidResize",
    "JobFinished",
    "check_user_checkpoint_url",
    "checkpoint_claims",
    "checkpoint_prefix_conflict",
    "default_prefix_job",
    "new_event",
    "new_job",
    "new_job_id",
    "plan_resize",
    "resize_changes",
    "resized_spec",
    "resolve_checkpoint_url",
    "submit_refusal",
    "user_submit_limits",
]


class JobFinished(Exception):
    """The job is in a terminal state: it cannot be changed any more."""


class InvalidResize(ValueError):
    """The resized spec is not valid; ``problems`` are ``(field, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems = problems


class CheckpointUrlRefused(ValueError):
    """The spec's checkpoint URL may not be the job's (the API's 422 naming ``checkpoint_url``); the message: why."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(why)
        self.url = url


class CheckpointOutsideRoot(CheckpointUrlRefused):
    """The spec's checkpoint URL does not lie below the service's checkpoint ``root``."""

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url, f"must lie below the service's checkpoint root {root}")
        self.root = root


def new_event(kind: str, message: str, now: datetime, **data: object) -> Event:
    """An event written outside the reconcile loop (the API): time-ordered id, random suffix."""
    return Event(
        id=f"{int(now.timestamp() * 1_000_000):017d}-a{secrets.token_hex(3)}",
        time=now,
        type=kind,
        message=message,
        data=dict(data),
    )


# -- checkpoint-prefix ownership -------------------------------------------------------------------------
def checkpoint_claims(entries: Iterable[JobEntry], *, started_only: bool = False) -> dict[str, str]:
    """Job id -> checkpoint prefix of the jobs that hold theirs: every non-terminal job with a prefix, from its
    submit on. ``started_only``: only those that have started (generation > 0), as the reconcile loop asks;
    its placement claims the prefixes of the jobs it starts as it goes, oldest first, so that of two waiting
    jobs on one prefix the first to start keeps it and the other fails."""
    return {
        e.record.id: e.record.checkpoint_url
        for e in entries
        if e.record.checkpoint_url is not None
        and not e.status.state.terminal
        and (not started_only or e.status.generation > 0)
    }


def checkpoint_prefix_conflict(url: str, entries: Iterable[JobEntry]) -> str | None:
    """The active job whose checkpoint prefix overlaps ``url`` (a new job's), or None: a submit's check."""
    return checkpoint_prefix_owner(url, checkpoint_claims(entries))


# -- submit --------------------------------------------------------------------------------------------------
def resolve_checkpoint_url(spec: JobSpec, root: str | None, job_id: str) -> str | None:
    """The job's checkpoint prefix: the spec's or ``<root>/<id>``. With a ``root`` the spec's must lie strictly
    below it (:class:`CheckpointOutsideRoot`; the root itself, or a URL that contains it:
    :class:`CheckpointUrlRefused`), since a prefix overlapping the root overlaps every job's and would hold up
    every submit while its job waits. Whose default prefix a user's URL may lie in:
    :func:`check_user_checkpoint_url`."""
    if root is None:
        return spec.checkpoint_url
    root = normalize_checkpoint_url(root)
    url = spec.checkpoint_url
    if url is None:
        return f"{root}/{job_id}"
    if checkpoint_url_within(root, url):
        itself = checkpoint_url_within(url, root)
        what = "is the service's checkpoint root" if itself else "contains the service's checkpoint root"
        raise CheckpointUrlRefused(
            url,
            f"{what} {root}: a job's prefix must lie below it (default <root>/<job id>), "
            "as one that holds the root overlaps every other job's",
        )
    if not checkpoint_url_within(url, root):
        raise CheckpointOutsideRoot(url, root)
    return url


def default_prefix_job(url: str, root: str) -> str | None:
    """The job id whose default prefix ``<root>/<id>`` holds ``url`` (a URL below ``root``): its first segment below
    the root when that has the form of a job id (``<name>-<8 hex>``; compared percent-decoded and without regard to
    case, as some stores would take it), else None."""
    below = _segments(url)[len(_segments(root)) :]
    if not below:
        return None
    first = unquote(below[0])
    return first.lower() if _JOB_ID.fullmatch(first) else None


def check_user_checkpoint_url(url: str, root: str | None, user: str, owner: Callable[[str], str | None]) -> None:
    """A ``user`` token's explicit checkpoint ``url`` (below ``root``) may lie in a job's default prefix
    ``<root>/<id>`` only when that job is ``user``'s own (``owner(id)``: who submitted job ``id``, None if there is
    none): another user's default prefix holds that user's checkpoints, and that of a job not there (yet) is kept
    for the job that gets that id. Raises :class:`CheckpointUrlRefused`; admin tokens are not asked."""
    if root is None:
        return
    root = normalize_checkpoint_url(root)
    job = default_prefix_job(url, root)
    if job is None:
        return
    submitter = owner(job)
    if submitter == user:
        return
    whose = (
        f"job {job} was submitted by another user"
        if submitter is not None
        else f"no job {job} of user {user} exists, and the name is kept for the job that gets that id"
    )
    raise CheckpointUrlRefused(
        url,
        f"lies in {root}/{job}, the default checkpoint prefix of job {job}, and {whose}: "
        "below the root give a directory whose name is not a job id (<name>-<8 hex "
        "digits>)",
    )


_JOB_ID = re.compile(rf"(?:{NAME_PATTERN.removeprefix('^').removesuffix('$')})-[0-9a-f]{{8}}", re.IGNORECASE)


def _segments(url: str) -> list[str]:
    """The path segments of ``url`` as the prefix rules compare them (empty and ``.`` segments dropped)."""
    return [p for p in urlparse(normalize_checkpoint_url(url)).path.split("/") if p not in ("", ".")]


def new_job_id(spec: JobSpec) -> str:
    """``<name>-<8 random hex digits>``."""
    return f"{spec.name}-{secrets.token_hex(4)}"


def new_job(
    spec: JobSpec, job_id: str, url: str | None, submitted_by: str, now: datetime
) -> tuple[JobRecord, JobStatus, Event]:
    """The records of a new job: its record (with a fresh checkpoint key), its pending status and its
    ``submitted`` event."""
    record = JobRecord(
        id=job_id,
        spec=spec,
        created_at=now,
        checkpoint_url=url,
        submitted_by=submitted_by,
        checkpoint_key=secrets.token_hex(32),
    )
    status = JobStatus(created_at=now, updated_at=now)
    event = new_event("submitted", f"submitted by {submitted_by}", now, checkpoint_url=url)
    return record, status, event


# -- resize --------------------------------------------------------------------------------------------------
def resized_spec(spec: JobSpec, min_nodes: int, max_nodes: int) -> JobSpec:
    """``spec`` with new node bounds, validated as a submitted spec is (the model, then
    :func:`submit_problems`); raises :class:`InvalidResize` naming the fields."""
    try:
        new = JobSpec.model_validate({**spec.model_dump(), "min_nodes": min_nodes, "max_nodes": max_nodes})
    except ValidationError as exc:
        raise InvalidResize(
            [(".".join(str(p) for p in e["loc"]) or "spec", str(e["msg"])) for e in exc.errors()]
        ) from None
    problems = submit_problems(new)
    if problems:
        raise InvalidResize(problems)
    return new


def resize_changes(spec: JobSpec, min_nodes: int | None, max_nodes: int | None) -> dict[str, tuple[int, int]]:
    """The bounds a resize changes: name -> ``(old, new)``; None asks for no change of that bound."""
    sizes = {
        "min_nodes": (spec.min_nodes, spec.min_nodes if min_nodes is None else min_nodes),
        "max_nodes": (spec.max_nodes, spec.max_nodes if max_nodes is None else max_nodes),
    }
    return {name: (a, b) for name, (a, b) in sizes.items() if a != b}


def plan_resize(
    record: JobRecord,
    status: JobStatus,
    min_nodes: int | None,
    max_nodes: int | None,
    *,
    requested_by: str | None,
    now: datetime,
) -> tuple[JobRecord, Event] | None:
    """The job's record with new ``min_nodes`` / ``max_nodes`` (None: unchanged) and its ``resize`` event; None
    when the sizes asked for are the job's already (nothing to write). A terminal job raises
    :class:`JobFinished`; a new spec a submit would refuse, :class:`InvalidResize`."""
    if status.state.terminal:
        raise JobFinished(f"job {record.id} already {status.state.value}: it cannot be resized")
    old = record.spec
    changed = resize_changes(old, min_nodes, max_nodes)
    if not changed:
        return None
    new_min = changed.get("min_nodes", (old.min_nodes, old.min_nodes))[1]
    new_max = changed.get("max_nodes", (old.max_nodes, old.max_nodes))[1]
    spec = resized_spec(old, new_min, new_max)
    message = ", ".join(f"{name} {a} -> {b}" for name, (a, b) in changed.items())
    data: dict[str, Any] = {name: {"old": a, "new": b} for name, (a, b) in changed.items()}
    event = new_event(
        "resize", message + (f" (by {requested_by})" if requested_by else ""), now, requested_by=requested_by, **data
    )
    return record.model_copy(update={"spec": spec}), event


# -- who may submit what ------------------------------------------------------------------------------------
#: what a ``user`` token may submit where the quotas file grants it nothing (no ``--quotas``, a user it does not
#: name, a limit neither its entry nor ``limits.default`` sets): priority 0 at most, no queue, any number pending.
#: Secure by default: a user token cannot preempt anyone, nor spend a queue's quota, until an operator says so.
#: what a user token may where the quotas file grants nothing: priority 0 at most, no queue, and 1,000 jobs stored at
#: once (cancelled and finished ones count until the retention deletes them: submit-then-cancel stored any number of
#: specs, each kept 7 days, until etcd's reads of them failed)
UNGRANTED_LIMITS = SubmitLimits(max_priority=0, queues=frozenset(), max_pending=None, max_jobs=1000)


def user_submit_limits(quotas: Quotas, user: str) -> SubmitLimits:
    """The limits of the ``user`` token named ``user``: its own in the quotas file's ``limits.users``, those unset
    from ``limits.default``, those still unset from :data:`UNGRANTED_LIMITS` (admin tokens have none)."""
    return quotas.submit_limits(user).over(UNGRANTED_LIMITS)


def submit_refusal(spec: JobSpec, user: str, quotas: Quotas, jobs: Iterable[JobEntry]) -> tuple[int, str] | None:
    """Why ``user`` (a ``user`` token's name) may not submit ``spec`` now, as ``(HTTP status, message)``: 403 for a
    priority above its maximum or a queue it may not use (:func:`user_submit_limits`), 429 while it has
    ``max_pending`` jobs pending or ``max_jobs`` stored; None: it may. ``jobs``: every job the store holds."""
    granted = quotas.submit_limits(user)
    limits = granted.over(UNGRANTED_LIMITS)
    if limits.max_priority is not None and spec.priority > limits.max_priority:
        source = (
            "the quotas file's limits"
            if granted.max_priority is not None
            else "max_priority, the default where the quotas file's limits grant none: an operator grants more there"
        )
        return 403, f"priority {spec.priority} is above the maximum of user {user} ({limits.max_priority}; {source})"
    if spec.queue is not None and limits.queues is not None and spec.queue not in limits.queues:
        allowed = ", ".join(sorted(limits.queues)) or "none"
        source = (
            ""
            if granted.queues is not None
            else "; no queue is allowed where the quotas file's limits grant none: an operator grants queues there"
        )
        return 403, f"user {user} may not submit to queue {spec.queue} (its queues: {allowed}{source})"
    jobs = list(jobs)
    if limits.max_jobs is not None:
        stored = sum(1 for e in jobs if e.record.submitted_by == user)
        if stored >= limits.max_jobs:
            return 429, (
                f"user {user} has {stored} job(s) stored, its most (max_jobs {limits.max_jobs}), finished and "
                "cancelled ones included until the retention deletes them: submit again then, or ask an "
                "operator to raise max_jobs in the quotas file"
            )
    if limits.max_pending is not None:
        pending = sum(1 for e in jobs if e.record.submitted_by == user and e.status.state == JobState.PENDING)
        if pending >= limits.max_pending:
            return 429, (
                f"user {user} has {pending} pending job(s), its most (max_pending {limits.max_pending}): "
                "submit again when one has started or ended"
            )
    return None
