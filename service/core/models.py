"""Pydantic models of the job service: the records kept in etcd, and (re-exported from
:mod:`service.core.spec`, their home) the job spec users submit.

Durations are ``timedelta`` fields; in JSON and YAML they are given as seconds (``5``, ``0.5``) or as
ISO 8601 durations (``PT5S``) and written back as seconds.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from enum import Enum
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from elastic.contract.recovery import RecoveryMode
from service.core.spec import (
    MAX_NODES_PER_JOB,
    NAME_PATTERN,
    NODE_NAME_PATTERN,
    RESERVED_ENV,
    JobSpec,
    LRPolicySpec,
    RendezvousOptions,
    RestartPolicy,
    checkpoint_prefix_owner,
    checkpoint_url_within,
    normalize_checkpoint_url,
    submit_problems,
)
from service.core.states import JobState

__all__ = [
    "MAX_NODES_PER_JOB",
    "NAME_PATTERN",
    "NODE_MODES",
    "NODE_NAME_PATTERN",
    "RESERVED_ENV",
    "Assignment",
    "CheckpointInfo",
    "Event",
    "EventMark",
    "Isolation",
    "JobRecord",
    "JobSpec",
    "JobStatus",
    "LRPolicySpec",
    "NodeControl",
    "NodeInfo",
    "NodeMode",
    "RecoveryMode",
    "RendezvousOptions",
    "RestartPolicy",
    "Restarts",
    "WorkerReport",
    "WorldSizeChange",
    "checked_logs_url",
    "checkpoint_prefix_owner",
    "checkpoint_url_within",
    "node_mode",
    "normalize_checkpoint_url",
    "rdzv_run_id",
    "rdzv_runs_prefix",
    "submit_problems",
]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_timedelta="float")


class JobRecord(_Record):
    """``<prefix>/jobs/<id>``: the submitted spec (immutable after submission)."""

    id: str
    spec: JobSpec
    created_at: datetime
    checkpoint_url: str | None = Field(default=None, description="resolved: the spec's, or the default prefix")
    submitted_by: str | None = None
    # hex HMAC key of the job's snapshot manifests, made at submit: only this job's workers get it (never
    # shown by the API), so nothing another job writes under this prefix is ever loaded by this one
    checkpoint_key: str | None = Field(default=None, repr=False)


class WorldSizeChange(_Record):
    at: datetime
    world_size: int
    nodes: list[str]
    generation: int


class Restarts(_Record):
    failure: int = Field(default=0, description="generations restarted after failed workers")
    membership: int = Field(default=0, description="nodes lost or added while running")
    in_place: int = Field(default=0, description="torchrun worker-group restarts within a generation (any cause)")
    planned: int = Field(
        default=0,
        description="nodes taken away on purpose (shrunk for a higher-priority job, drained, resized), each "
        "after a snapshot at a step boundary, or whose agent stopped (SIGTERM: scancel, a walltime, a preemption): "
        "never a failure",
    )
    preempted: int = Field(
        default=0, description="times the whole job was stopped for a higher-priority job and requeued"
    )


class CheckpointInfo(_Record):
    step: int
    path: str | None = None
    committed_at: datetime


class EventMark(_Record):
    """The newest event the controller wrote of a job: one that repeats it (same type and message) rewrites that
    event with ``count`` + 1 instead of adding one (a job's events are bounded; see ``JobStatus.last_event``)."""

    id: str
    type: str
    message: str
    count: int = 1


class JobStatus(_Record):
    """``<prefix>/status/<id>``: everything the controller decided and observed about one job."""

    state: JobState = JobState.PENDING
    message: str = "waiting to be scheduled"
    generation: int = 0
    nodes: list[str] = Field(default_factory=list)
    world_size: int | None = None
    world_size_history: list[WorldSizeChange] = Field(default_factory=list)
    restarts: Restarts = Field(default_factory=lambda: Restarts())
    checkpoint: CheckpointInfo | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    # steps per second between the job's last two progress reports (None: its first, or across a restart)
    steps_per_s: float | None = None
    progress_at: datetime | None = None
    last_error: str | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # bookkeeping of the recovery logic
    generation_started_at: datetime | None = None
    generation_first_step: int | None = None
    generation_progressed: bool = False
    startup_failures: int = 0
    seen_restart_count: int = 0
    disrupted_at: datetime | None = None
    failure_seen_at: datetime | None = None
    success_seen_at: datetime | None = None
    backoff_until: datetime | None = None
    node_failures: dict[str, int] = Field(default_factory=dict)
    blacklist: dict[str, datetime] = Field(default_factory=dict)
    # nodes taken away by planned shrinks and not yet given back: growing onto them again does not count
    # against max_membership_changes
    planned_out: int = 0
    # nodes this job lost (lease expired, or a torchrun killed in live mode) not yet replaced: it may take hot
    # spares for them
    lost_owed: int = 0
    # the newest event the controller wrote: the same again only counts up its ``repeats``
    last_event: EventMark | None = None


class Event(_Record):
    """``<prefix>/events/<job id>/<id>``: one thing that happened to a job."""

    id: str
    time: datetime
    type: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class Isolation(str, Enum):
    """How the jobs on a node are kept apart (reported in the node's registration)."""

    #: each job runs as a uid and gid of its own (``--job-uid-range``)
    UID = "uid"
    #: the agent cannot switch uid: jobs run as the agent's uid, and only one owner's (``--job-owner``)
    OWNER = "owner"
    #: jobs of any owner run as the agent's uid: they can read each other's secrets (and the agent's files)
    NONE = "none"


class NodeInfo(_Record):
    """``<prefix>/nodes/<name>``: a live agent (the key lives on the agent's lease)."""

    name: str
    capacity: int = Field(description="worker processes this node can run (--nproc-per-node)")
    rdzv_host: str | None = None
    hostname: str | None = None
    pid: int | None = None
    incarnation: str
    registered_at: datetime
    lease_ttl: float | None = None
    # a hot spare (``etrain agent --spare``): held back for jobs that lost a node, with a zygote that has torch
    # imported waiting for their workers
    spare: bool = False
    # where the agent serves its jobs' logs (``etrain agent --logs-port``): the controller proxies
    # ``GET /v1/jobs/{id}/logs`` there with ``logs_token`` as bearer token (never shown by the API)
    logs_url: str | None = None
    logs_token: str | None = Field(default=None, repr=False)
    # how the jobs on this node are kept apart (service.agent.isolation); with ``owner`` set only that owner's
    # jobs are placed here (an agent that cannot switch uid, started with --job-owner)
    isolation: Isolation = Isolation.NONE
    owner: str | None = None


#: host names an agent's ``logs_url`` may always name besides its registered hosts (one machine, no --rdzv-host)
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
#: ``scheme://netloc`` and at most a trailing ``/``: no path, query, fragment (even an empty one), nor whitespace
_LOGS_URL = re.compile(r"https?://[^/?#\\\s]+/?")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]{0,252})")


def checked_logs_url(info: NodeInfo) -> str:
    """The base URL of node ``info``'s log server, rebuilt from the checked parts of its ``logs_url``; raises
    :class:`ValueError` saying what is wrong.

    ``logs_url`` comes from etcd, written by whoever can write the node's key: the controller sends a request
    (with the agent's token) only to ``http(s)://<host>:<port>`` where the scheme is http or https, the port a
    number, ``host`` one of the node's registered hosts (``rdzv_host``, ``hostname``) or a loopback name, and
    the URL has no user info, path, query or fragment. The caller appends its own fixed path."""
    raw = info.logs_url or ""
    if not _LOGS_URL.fullmatch(raw):
        raise ValueError("it must be http(s)://HOST:PORT, without a path, query, fragment or spaces")
    parts = urlsplit(raw)
    try:
        port = parts.port
    except ValueError:
        raise ValueError("its port is not a number from 1 to 65535") from None
    if "@" in parts.netloc:
        raise ValueError("it must carry no user info")
    if port is None or port == 0:
        raise ValueError("it names no port")
    host = (parts.hostname or "").lower()
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None and not _HOST_NAME.fullmatch(host):
        raise ValueError(f"its host {host!r} is no host name or IP address")
    registered = {h.lower() for h in (info.rdzv_host, info.hostname) if h}
    if host not in registered | _LOOPBACK_HOSTS:
        raise ValueError(
            f"its host {host!r} is none of the node's registered hosts "
            f"({', '.join(sorted(registered)) or 'none'}) nor loopback"
        )
    shown = f"[{host}]" if ip is not None and ip.version == 6 else host
    return f"{parts.scheme}://{shown}:{port}"


class NodeMode(str, Enum):
    """What an operator asked of a node (``etrain node cordon|drain|uncordon``)."""

    #: no new job is placed on it; the jobs running there stay
    CORDONED = "cordoned"
    #: cordoned, and its jobs move off through planned scale-down (a snapshot first, never a failure): each
    #: to a free node if one fits, else it shrinks if above ``min_nodes``, else it requeues
    DRAINING = "draining"


class NodeControl(_Record):
    """``<prefix>/nodectl/<name>``: an operator's request about a node. Not on the agent's lease: it outlives
    agent restarts, and may name a node that has not registered yet. Uncordon deletes it."""

    name: str
    mode: NodeMode
    requested_by: str | None = None
    at: datetime
    reason: str | None = Field(default=None, max_length=1000)


#: how the API and the metrics show a node's mode (``node_mode``)
NODE_MODES = ("active", "cordoned", "draining", "drained")


def node_mode(control: NodeControl | None, busy: bool) -> str:
    """A node's mode as shown (one of :data:`NODE_MODES`): ``active`` (no request), ``cordoned``, ``draining``
    (a drain request while an active job still holds the node) or ``drained`` (a drain request and no active
    job left on the node). ``busy``: an active job holds the node."""
    if control is None:
        return "active"
    if control.mode == NodeMode.DRAINING:
        return "draining" if busy else "drained"
    return control.mode.value


def rdzv_runs_prefix(job_id: str) -> str:
    """What every torchrun run id of job ``job_id`` starts with, and no other job's does: ``<job id>.g``. Job
    names (``NAME_PATTERN``) and so job ids never hold a ``.``: no job id starts with another's followed by ``.``."""
    return f"{job_id}.g"


def rdzv_run_id(job_id: str, generation: int) -> str:
    """torchrun's ``--rdzv-id`` of one generation of a job: ``<job id>.g<generation>``."""
    return f"{rdzv_runs_prefix(job_id)}{generation}"


class Assignment(_Record):
    """``<prefix>/assign/<node>/<job id>``: the controller asks a node to run one generation of a job."""

    job_id: str
    generation: int
    spec: JobSpec
    checkpoint_url: str | None = None
    checkpoint_key: str | None = Field(default=None, repr=False, description="hex: signs the job's snapshots")
    # where the generation's torchrun rendezvous lives: chosen by the controller (one value for all the nodes of a
    # generation, whatever version each agent runs); None (an older controller): the agent's legacy default
    rdzv_prefix: str | None = None
    assigned_at: datetime
    # the job's own etcd user (service.controller.identities), made by the leader when the control plane
    # authenticates to etcd with a password: torchrun's rendezvous and the workers use it, never the
    # control plane's user. None: the control plane uses no etcd password (jobs share its identity).
    etcd_user: str | None = None
    etcd_password: str | None = Field(default=None, repr=False)
    # who submitted the job (its record's ``submitted_by``): an agent that runs one owner's jobs only refuses others
    owner: str | None = None

    # torchrun's run id, chosen by the controller (``rdzv_run_id``); None (an older controller): the legacy
    # ``<job id>-g<generation>``, which a job named ``<job id>-g...`` could share a grant prefix with
    rdzv_run: str | None = None

    @property
    def rdzv_id(self) -> str:
        return self.rdzv_run or f"{self.job_id}-g{self.generation}"


class WorkerReport(_Record):
    """``<prefix>/reports/<node>/<job id>``: what the node's torchrun for the job is doing."""

    job_id: str
    node: str
    generation: int
    state: Literal["running", "exited", "stopped", "launch_failed"]
    pid: int | None = Field(
        default=None,
        description="the process the agent started: torchrun, or for a warm job the prefork client that runs it "
        "(it forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2 and SIGCONT to torchrun and exits as it does; "
        "elastic.prefork.forked_worker(pid) gives torchrun's own pid)",
    )
    exit_code: int | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    # stopped because the agent itself was stopping (SIGTERM: scancel, a walltime, a preemption, an operator): the
    # node then leaves on purpose, which the job's membership budget does not count
    planned: bool = False

    @property
    def failed(self) -> bool:
        return self.state == "launch_failed" or (self.state == "exited" and self.exit_code != 0)

    @property
    def succeeded(self) -> bool:
        return self.state == "exited" and self.exit_code == 0
