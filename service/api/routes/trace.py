"""``GET /v1/jobs/{id}/trace``: a job's history as Chrome trace JSON (open it in Perfetto or chrome://tracing).

The trace itself is built by the pure :func:`service.core.trace.job_trace`; this route only reads what it needs:
the job, its events, its latest progress report and the agents' worker reports. A read token suffices, as for
the job's events: the trace shows nothing the events and the status do not (no env values, no log tails).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, status
from fastapi.responses import JSONResponse

from service.api.auth import require_read
from service.api.deps import get_store
from service.core.store import ServiceStore
from service.core.trace import job_trace

__all__ = ["MAX_TRACE_EVENTS", "router"]

router = APIRouter(prefix="/v1", tags=["jobs"])

#: the newest events of a job that a trace is built from (``metadata.events_truncated`` says when there were more)
MAX_TRACE_EVENTS = 100_000


@router.get(
    "/jobs/{job_id}/trace",
    summary="A job's history as Chrome trace JSON (Perfetto, chrome://tracing)",
    description="One track per node (worker generations, re-forms, failures with their cause), a controller "
    "track (states, job events, counters `step`, `world_size`, `loss`) and a snapshots track (commits). `ts` is in "
    "microseconds since `metadata.time_origin`; `metadata.not_recorded` lists what the service does not keep.",
    responses={
        200: {"description": "a Trace Event Format JSON object", "content": {"application/json": {}}},
        404: {"description": "no job with this id"},
    },
    response_class=JSONResponse,
    dependencies=[Depends(require_read)],
)
def get_job_trace(job_id: str, store: Annotated[ServiceStore, Depends(get_store)]) -> JSONResponse:
    entry = store.get_job(job_id)
    if entry is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job {job_id!r}")
    events = store.events(job_id, limit=MAX_TRACE_EVENTS + 1)  # the newest ones
    truncated = len(events) > MAX_TRACE_EVENTS
    trace: dict[str, Any] = job_trace(
        entry.record,
        entry.status,
        events[-MAX_TRACE_EVENTS:],
        datetime.now(timezone.utc),
        progress=store.progress(job_id),
        reports=store.reports(job_id),
        events_truncated=truncated,
    )
    return JSONResponse(trace)
