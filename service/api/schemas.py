"""Response bodies of the REST API (views over the records in ``service.core.models``)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from service.core.models import Event, JobSpec, NodeInfo, Restarts, WorldSizeChange
from service.core.series import MetricPoint, MetricWindow
from service.core.states import JobState
from service.core.view import JobEntry

__all__ = [
    "LOG_TAIL_HIDDEN",
    "REDACTED",
    "BudgetView",
    "CheckpointView",
    "EventList",
    "JobDetail",
    "JobList",
    "JobResize",
    "JobSummary",
    "NodeControlRequest",
    "NodeList",
    "NodeOperation",
    "NodeView",
    "ProgressView",
    "WorldSizeView",
    "job_detail",
    "job_summary",
]


class _View(BaseModel):
    model_config = ConfigDict(ser_json_timedelta="float")


class WorldSizeView(_View):
    current: int | None = Field(description="world size the workers last reported in this generation")
    expected: int | None = Field(description="nodes assigned x nproc_per_node (None: no nodes assigned)")
    history: list[WorldSizeChange]


class BudgetView(_View):
    max_failures: int
    failures_left: int
    max_membership_changes: int
    membership_changes_left: int


class CheckpointView(_View):
    url: str | None = Field(description="the job's checkpoint prefix")
    step: int | None = Field(default=None, description="step of the latest committed checkpoint")
    path: str | None = None
    committed_at: datetime | None = None


class ProgressView(_View):
    step: int | None
    total_steps: int | None
    loss: float | None
    updated_at: datetime | None


class JobSummary(_View):
    id: str
    name: str
    state: JobState
    message: str
    created_at: datetime
    nodes: list[str]
    world_size: int | None
    step: int | None
    total_steps: int | None
    restarts: Restarts


class JobDetail(_View):
    id: str
    name: str
    state: JobState
    message: str
    cancel_requested: bool
    spec: JobSpec
    submitted_by: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    generation: int
    nodes: list[str]
    world_size: WorldSizeView
    restarts: Restarts
    restart_budget: BudgetView
    checkpoint: CheckpointView
    progress: ProgressView
    last_error: str | None
    backoff_until: datetime | None
    blacklist: dict[str, datetime]


class JobList(_View):
    jobs: list[JobSummary]
    next: str | None = Field(default=None, description="pass as `after` for the next page (None: last page)")


class EventList(_View):
    job_id: str
    events: list[Event]


class MetricSeriesView(_View):
    """A job's metric series from its first report: ``windows`` (older reports, downsampled: each value's
    ``[first, last, min, max]``) then ``points`` (the newest reports, as reported), both oldest first."""

    job_id: str
    count: int = Field(description="progress reports kept since the job's start (in windows and points)")
    windows: list[MetricWindow]
    points: list[MetricPoint]


NodeModeName = Literal["active", "cordoned", "draining", "drained"]


class NodeView(NodeInfo):
    # the agent's log-server token is for the controller alone: accepted (the node list is built from the whole
    # NodeInfo) but never serialized, nor in the schema
    logs_token: SkipJsonSchema[str | None] = Field(default=None, exclude=True, repr=False)
    jobs: list[str] = Field(default_factory=list, description="jobs assigned to this node")
    free: int = Field(description="capacity not used by assigned jobs")
    # a node listed only for its cordon / drain request (not registered now) has no agent fields
    capacity: int = Field(default=0, description="worker processes this node can run (0: not live)")
    incarnation: str | None = None  # type: ignore[assignment]
    registered_at: datetime | None = None  # type: ignore[assignment]
    live: bool = Field(default=True, description="false: no agent registered now (listed for its request)")
    mode: NodeModeName = Field(
        default="active",
        description="active; cordoned (no new job placed); draining (its jobs move off); drained (draining and "
        "no active job left on it)",
    )
    reason: str | None = Field(default=None, description="the operator's reason for the cordon / drain")
    mode_requested_by: str | None = Field(default=None, description="who cordoned or drained the node")
    mode_since: datetime | None = Field(default=None, description="when the cordon / drain was requested")


class NodeList(_View):
    nodes: list[NodeView]


class NodeOperation(NodeView):
    """The node after ``POST /v1/nodes/{name}/cordon|drain|uncordon``."""

    changed: bool = Field(description="false: the node already was in the asked mode (nothing written)")
    message: str


class NodeControlRequest(BaseModel):
    """Body of ``POST /v1/nodes/{name}/cordon|drain|uncordon`` (optional)."""

    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=1000, description="why (shown with the node)")


class JobResize(BaseModel):
    """Body of ``PATCH /v1/jobs/{id}``: new node bounds (an omitted one is unchanged)."""

    model_config = ConfigDict(extra="forbid")
    min_nodes: int | None = Field(default=None, ge=1, le=4096)
    max_nodes: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _at_least_one(self) -> JobResize:
        if self.min_nodes is None and self.max_nodes is None:
            raise ValueError("give min_nodes, max_nodes or both")
        return self


def job_summary(entry: JobEntry) -> JobSummary:
    st, rec = entry.status, entry.record
    return JobSummary(
        id=rec.id,
        name=rec.spec.name,
        state=st.state,
        message=st.message,
        created_at=rec.created_at,
        nodes=st.nodes,
        world_size=st.world_size,
        step=st.step,
        total_steps=st.total_steps,
        restarts=st.restarts,
    )


REDACTED = "<redacted>"
LOG_TAIL_HIDDEN = "(the workers' log tail is shown to the job's owner and admin tokens only)"


def job_detail(entry: JobEntry, *, secrets: bool) -> JobDetail:
    """The job as the API shows it. ``secrets`` False (read tokens, other users' tokens): the values of ``spec.env``
    (users pass credentials there), ``spec.args`` and the workers' log tail in ``last_error`` are withheld."""
    st, rec = entry.status, entry.record
    policy = rec.spec.restart_policy
    ckpt = st.checkpoint
    spec = (
        rec.spec
        if secrets
        else rec.spec.model_copy(
            update={"env": dict.fromkeys(rec.spec.env, REDACTED), "args": [REDACTED] * len(rec.spec.args)}
        )
    )
    last_error = st.last_error
    if not secrets and last_error is not None and "\n" in last_error:
        last_error = last_error.split("\n", 1)[0] + "\n" + LOG_TAIL_HIDDEN
    return JobDetail(
        id=rec.id,
        name=rec.spec.name,
        state=st.state,
        message=st.message,
        cancel_requested=entry.cancel_requested,
        spec=spec,
        submitted_by=rec.submitted_by,
        created_at=rec.created_at,
        updated_at=st.updated_at,
        started_at=st.started_at,
        finished_at=st.finished_at,
        generation=st.generation,
        nodes=st.nodes,
        world_size=WorldSizeView(
            current=st.world_size,
            expected=len(st.nodes) * rec.spec.nproc_per_node if st.nodes else None,
            history=st.world_size_history,
        ),
        restarts=st.restarts,
        restart_budget=BudgetView(
            max_failures=policy.max_failures,
            failures_left=max(policy.max_failures - st.restarts.failure, 0),
            max_membership_changes=policy.max_membership_changes,
            membership_changes_left=max(policy.max_membership_changes - st.restarts.membership, 0),
        ),
        checkpoint=CheckpointView(
            url=rec.checkpoint_url,
            step=ckpt.step if ckpt else None,
            path=ckpt.path if ckpt else None,
            committed_at=ckpt.committed_at if ckpt else None,
        ),
        progress=ProgressView(step=st.step, total_steps=st.total_steps, loss=st.loss, updated_at=st.progress_at),
        last_error=last_error,
        backoff_until=st.backoff_until,
        blacklist=st.blacklist,
    )
