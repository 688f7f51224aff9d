"""``/v1/jobs``: submit, list, inspect, resize, cancel jobs and read their events."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, status
from fastapi.exceptions import RequestValidationError

from service.api.auth import Principal, check_owner, owns, require_read, require_user
from service.api.deps import get_metrics, get_settings, get_store
from service.api.schemas import (
    EventList,
    JobDetail,
    JobList,
    JobResize,
    MetricSeriesView,
    job_detail,
    job_summary,
)
from service.controller.metrics import Metrics
from service.core.config import Role, Settings
from service.core.jobs import (
    CheckpointUrlRefused,
    InvalidResize,
    JobFinished,
    check_user_checkpoint_url,
    checkpoint_prefix_conflict,
    new_event,
    new_job,
    new_job_id,
    resolve_checkpoint_url,
    submit_refusal,
)
from service.core.models import JobSpec, submit_problems
from service.core.series import fit
from service.core.states import JobState
from service.core.store import JobExists, JobNotFound, ResizeConflict, ServiceStore, SubmitRaced
from service.core.view import JobEntry

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["jobs"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no job with this id"}}


def _resolve_checkpoint_url(
    spec: JobSpec, root: str | None, job_id: str, principal: Principal, store: ServiceStore
) -> str | None:
    """The job's checkpoint prefix (``service.core.jobs.resolve_checkpoint_url``; a user token's own URL also
    ``check_user_checkpoint_url``); refused: a 422 naming ``checkpoint_url``."""

    def owner(other: str) -> str | None:
        entry = store.get_job(other)
        return None if entry is None else entry.record.submitted_by

    try:
        url = resolve_checkpoint_url(spec, root, job_id)
        if url is not None and spec.checkpoint_url is not None and principal.role == Role.USER:
            check_user_checkpoint_url(url, root, principal.name, owner)
        return url
    except CheckpointUrlRefused as exc:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", "checkpoint_url"), "msg": str(exc), "input": exc.url}]
        ) from None


def _get(store: ServiceStore, job_id: str) -> JobEntry:
    entry = store.get_job(job_id)
    if entry is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job {job_id!r}")
    return entry


_SUBMIT_TRIES = 8  # a user's submit that raced another of its submits checks its limits again this many times


def _check_submit_limits(
    spec: JobSpec, principal: Principal, store: ServiceStore, settings: Settings
) -> tuple[str, int] | None:
    """Raise 403/429 when a ``user`` token may not submit ``spec`` now; else what :meth:`ServiceStore.create_job`
    needs to store the job only while the check still holds (None for admin tokens: operators have no limits)."""
    if principal.role != Role.USER:
        return None
    jobs, revision = store.jobs_for_submit(principal.name)
    refusal = submit_refusal(spec, principal.name, settings.reconcile.quotas, jobs)
    if refusal is not None:
        raise HTTPException(refusal[0], detail=refusal[1])
    return principal.name, revision


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    summary="Submit a job",
    responses={
        403: {"description": "a user token's priority above its maximum, or a queue it may not use"},
        409: {"description": "the checkpoint prefix overlaps an active job's"},
        429: {"description": "the user has as many pending jobs as its limits allow"},
        503: {"description": "the user's own submits kept racing each other; retry"},
    },
)
def submit_job(
    spec: JobSpec,
    principal: Annotated[Principal, Depends(require_user)],
    store: Annotated[ServiceStore, Depends(get_store)],
    settings: Annotated[Settings, Depends(get_settings)],
    metrics: Annotated[Metrics, Depends(get_metrics)],
) -> JobDetail:
    problems = submit_problems(spec)
    if problems:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", field), "msg": msg, "input": None} for field, msg in problems]
        )
    submitter = _check_submit_limits(spec, principal, store, settings)
    now = datetime.now(timezone.utc)
    job_id = new_job_id(spec)
    url = _resolve_checkpoint_url(spec, settings.checkpoint_root, job_id, principal, store)
    if url is not None:
        owner = checkpoint_prefix_conflict(url, store.list_jobs())
        if owner is not None:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail=f"checkpoint_url {url} overlaps the checkpoint prefix of active job {owner}",
            )
    record, job_status, event = new_job(spec, job_id, url, principal.name, now)
    for _ in range(_SUBMIT_TRIES):
        try:
            store.create_job(record, job_status, event, submitter)
            break
        except JobExists:  # 32 random bits collided: the client may simply retry
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job id {job_id} exists; retry") from None
        except SubmitRaced:  # another submit of this user landed since the check: check again
            submitter = _check_submit_limits(spec, principal, store, settings)
    else:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"user {principal.name} submitted too many jobs at once; retry"
        )
    metrics.jobs_submitted.inc()
    return job_detail(JobEntry(record, job_status, 0), secrets=True)


@router.get("/jobs", summary="List jobs, oldest first, a page at a time", dependencies=[Depends(require_read)])
def list_jobs(
    store: Annotated[ServiceStore, Depends(get_store)],
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="jobs per page")] = 200,
    after: Annotated[str | None, Query(description="the `next` of the previous page")] = None,
) -> JobList:
    entries = [e for e in store.list_jobs() if state is None or e.status.state == state]
    if after is not None:
        entries = [e for e in entries if _cursor(e) > after]
    page = entries[:limit]
    return JobList(jobs=[job_summary(e) for e in page], next=_cursor(page[-1]) if len(entries) > limit else None)


def _cursor(entry: JobEntry) -> str:
    """Sorts like the list (creation time, then id): a page boundary that survives deletions."""
    return f"{entry.record.created_at.astimezone(timezone.utc).strftime('%Y%m%dT%H%M%S.%fZ')}~{entry.record.id}"


@router.get(
    "/jobs/{job_id}",
    summary="Job status (but to its owner and admins: env values, args and log tails withheld)",
    responses=_NOT_FOUND,
)
def get_job(
    job_id: str,
    principal: Annotated[Principal, Depends(require_read)],
    store: Annotated[ServiceStore, Depends(get_store)],
) -> JobDetail:
    entry = _get(store, job_id)
    return job_detail(entry, secrets=owns(principal, entry.record.submitted_by))


@router.patch(
    "/jobs/{job_id}",
    summary="Resize a job: new min_nodes and/or max_nodes (the leader grows or shrinks it, shrinking after a snapshot)",
    responses={
        **_NOT_FOUND,
        403: {"description": "another user's job"},
        409: {"description": "the job already finished, or kept changing (retry)"},
    },
)
def resize_job(
    job_id: str,
    body: JobResize,
    principal: Annotated[Principal, Depends(require_user)],
    store: Annotated[ServiceStore, Depends(get_store)],
) -> JobDetail:
    check_owner(principal, job_id, _get(store, job_id).record.submitted_by, "resize")
    try:
        entry = store.resize_job(job_id, body.min_nodes, body.max_nodes, requested_by=principal.name)
    except JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job {job_id!r}") from None
    except (JobFinished, ResizeConflict) as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
    except InvalidResize as exc:
        raise RequestValidationError(
            [
                {"type": "value_error", "loc": ("body", *field.split(".")), "msg": msg, "input": None}
                for field, msg in exc.problems
            ]
        ) from None
    return job_detail(entry, secrets=True)


@router.post(
    "/jobs/{job_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Cancel a job (the leader stops its workers)",
    responses={
        **_NOT_FOUND,
        403: {"description": "another user's job"},
        409: {"description": "the job already finished"},
    },
)
def cancel_job(
    job_id: str,
    principal: Annotated[Principal, Depends(require_user)],
    store: Annotated[ServiceStore, Depends(get_store)],
) -> JobDetail:
    entry = _get(store, job_id)
    check_owner(principal, job_id, entry.record.submitted_by, "cancel")
    if entry.status.state.terminal:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job_id} already {entry.status.state.value}")
    if not entry.cancel_requested:
        now = datetime.now(timezone.utc)
        store.request_cancel(job_id, new_event("cancel_requested", f"cancel requested by {principal.name}", now))
    return job_detail(_get(store, job_id), secrets=True)


@router.get(
    "/jobs/{job_id}/events",
    summary="A job's events, oldest first",
    responses=_NOT_FOUND,
    dependencies=[Depends(require_read)],
)
def job_events(
    job_id: str,
    store: Annotated[ServiceStore, Depends(get_store)],
    after: Annotated[str | None, Query(description="only events after this event id (for following)")] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> EventList:
    _get(store, job_id)
    return EventList(job_id=job_id, events=store.events(job_id, after=after, limit=limit))


@router.get(
    "/jobs/{job_id}/metrics",
    summary="A job's metric series (step, loss, steps/s, world size, restarts, snapshots) from its start",
    responses=_NOT_FOUND,
    dependencies=[Depends(require_read)],
)
def job_metrics(
    job_id: str,
    store: Annotated[ServiceStore, Depends(get_store)],
    since: Annotated[
        float | None,
        Query(
            description="only reports after this time (seconds since the epoch; "
            "a window ending after it is included whole)"
        ),
    ] = None,
    max_points: Annotated[
        int,
        Query(
            ge=2,
            le=100_000,
            description="at most this many windows and points "
            "together (windows merged, then points folded into windows)",
        ),
    ] = 2000,
) -> MetricSeriesView:
    _get(store, job_id)
    series = store.metric_series(job_id)
    windows, points = fit(*series.since(since), max_points)
    return MetricSeriesView(job_id=job_id, count=series.count, windows=windows, points=points)
