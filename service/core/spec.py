"""The job spec users submit (pydantic models) and its rules: names, environment, checkpoint URLs.

Durations are ``timedelta`` fields; in JSON and YAML they are given as seconds (``5``, ``0.5``) or as
ISO 8601 durations (``PT5S``) and written back as seconds. The records the service keeps in etcd are in
:mod:`service.core.models`, the plane's vocabulary module (which re-exports these names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from elastic.compat import DISABLE_SHARED_RDZV_STORE
from elastic.contract import env as contract
from elastic.contract import rendezvous as rdzv_contract
from elastic.contract.lr import LRPolicy, LRRule
from elastic.contract.recovery import RecoveryMode

__all__ = [
    "MAX_NODES_PER_JOB",
    "MAX_SPEC_BYTES",
    "NAME_PATTERN",
    "NODE_NAME_PATTERN",
    "RESERVED_ENV",
    "JobSpec",
    "LRPolicySpec",
    "RendezvousOptions",
    "RestartPolicy",
    "checkpoint_prefix_owner",
    "checkpoint_url_within",
    "normalize_checkpoint_url",
    "submit_problems",
]


NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"
NODE_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Environment variables the agent and torchrun set for workers; a job spec may not override them.
RESERVED_ENV = frozenset({*contract.TORCHRUN_WORKER_VARIABLES, DISABLE_SHARED_RDZV_STORE})
_RESERVED_ENV_PREFIXES = (contract.PREFIX, contract.TORCHRUN_PREFIX)
_CHECKPOINT_SCHEMES = ("file", "s3", "gs", "gcs", "az", "abfs")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_timedelta="float")


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError("must be a positive duration (seconds)")
    return value


class RestartPolicy(_Spec):
    """How often and how fast a job is restarted, with separate budgets per cause."""

    max_failures: int = Field(default=3, ge=0, le=1000, description="restarts after failed workers before failing")
    max_membership_changes: int = Field(
        default=20, ge=0, le=100000, description="nodes lost or added while running before failing"
    )
    max_worker_restarts: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="torchrun --max-restarts: in-place restarts within one generation",
    )
    backoff_initial: timedelta = Field(default=timedelta(seconds=2), description="first restart delay (doubles)")
    # validate_default: a spec giving only backoff_initial above the default cap must be refused here, not stored
    # and then be unreadable (found by the API fuzzer: such a job answered 201, then 404 for ever)
    backoff_max: timedelta = Field(
        default=timedelta(seconds=120), description="restart delay cap", validate_default=True
    )
    crash_loop_threshold: int = Field(
        default=3, ge=1, le=1000, description="consecutive generations failing before their first step: fail"
    )
    blacklist_after: int = Field(default=2, ge=1, le=1000, description="failures on one node before it is avoided")
    blacklist_cooldown: timedelta = Field(default=timedelta(minutes=10), description="how long a node is avoided")

    _check_positive = field_validator("backoff_initial", "backoff_max", "blacklist_cooldown")(_positive)

    @field_validator("backoff_max")
    @classmethod
    def _cap_above_initial(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        initial = info.data.get("backoff_initial")
        if initial is not None and value < initial:
            raise ValueError("must be at least backoff_initial")
        return value


class LRPolicySpec(_Spec):
    """How the training loop rescales the learning rate when the world size changes: a job spec's form of
    :class:`elastic.contract.lr.LRPolicy`, which :meth:`to_policy` builds (what the workers get).

    The rule's field is named ``scaling`` here and ``rule`` in the library: ``scaling`` is the documented
    job-spec field, kept in the job records stored in etcd (which refuse unknown fields), while ``rule`` is
    in the reference every checkpoint stores. This model is the one place that maps the two.
    """

    scaling: LRRule = Field(default=LRRule.LINEAR, description="the rule: " + ", ".join(r.value for r in LRRule))
    base_lr: float = Field(default=0.1, gt=0, le=1e6)
    base_world_size: int = Field(default=1, ge=1, le=1_000_000, description="world size base_lr is tuned for")
    base_batch_per_worker: int = Field(
        default=32, ge=1, le=1_000_000, description="per-worker batch base_lr is tuned for"
    )
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000, description="steps to ramp to a new LR after a change")
    accumulation_steps: int = Field(
        default=1, ge=1, le=100_000, description="micro-batches per worker and optimizer step at base_world_size"
    )

    def to_policy(self) -> LRPolicy:
        return LRPolicy(
            rule=self.scaling,
            base_lr=self.base_lr,
            base_world_size=self.base_world_size,
            base_batch_per_worker=self.base_batch_per_worker,
            warmup_steps=self.warmup_steps,
            accumulation_steps=self.accumulation_steps,
        )


class RendezvousOptions(_Spec):
    """torchrun ``--rdzv-conf`` settings of the job's ``etcd-v3`` rendezvous."""

    last_call_timeout: timedelta = Field(
        default=rdzv_contract.JOB_SERVICE_LAST_CALL_TIMEOUT, description="wait for more nodes after min"
    )
    join_timeout: timedelta = Field(
        default=rdzv_contract.DEFAULTS.join_timeout, description="wait for min nodes before failing"
    )
    node_ttl: timedelta = Field(
        default=rdzv_contract.DEFAULTS.node_ttl, description="lease TTL that detects a dead torchrun"
    )

    _check_positive = field_validator("last_call_timeout", "join_timeout", "node_ttl")(_positive)


class JobSpec(_Spec):
    """What to run: stock torchrun on between ``min_nodes`` and ``max_nodes`` nodes."""

    name: str = Field(pattern=NAME_PATTERN, description="lower-case letters, digits, '-' (max 40)")
    entrypoint: str = Field(min_length=1, max_length=4096, description="script path (or module, see module)")
    args: list[str] = Field(default_factory=list, max_length=1000)
    module: bool = Field(default=False, description="run the entrypoint as a module (torchrun -m)")
    warm_start: bool = Field(
        default=True,
        description="fork torchrun and each worker from the job's zygote on each node, which has torch imported "
        "(elastic.prefork), so a restart skips the interpreter and torch start-up; false: a fresh Python for "
        "torchrun and for each worker",
    )
    image: str | None = Field(default=None, max_length=1024, description="container image (for container agents)")
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = Field(default=None, max_length=4096, description="workers' cwd (agent's cwd if unset)")
    nproc_per_node: int = Field(default=1, ge=1, le=256)
    min_nodes: int = Field(default=1, ge=1, le=4096)
    # validate_default: a spec giving only min_nodes > 1 must be refused here, not stored and then be
    # unreadable (found by the schemathesis fuzz test: such a job answered 201, then 404 for ever).
    max_nodes: int = Field(default=1, ge=1, le=4096, validate_default=True)
    checkpoint_url: str | None = Field(default=None, max_length=4096, description="this job's checkpoint prefix")
    local_snapshot_every: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="node-local snapshot in memory (/dev/shm) every N steps, so a failure re-does at most N "
        "steps; costs one copy of the model + optimizer state in each node's memory; 0: off",
    )
    recovery: RecoveryMode = Field(
        default=RecoveryMode.RESTART,
        description="how the job goes on after a worker failure or a node lost or added: 'restart' (torchrun "
        "restarts every node's workers, which resume from the newest snapshot) or 'live' (torchrun's "
        "--rdzv-conf recovery=live: the surviving workers keep their processes and re-form in place; a "
        "restarted or new worker joins at a step boundary with a peer's state; needs the elastic loop)",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="scheduling priority: a job that does not fit shrinks running jobs of lower priority toward "
        "their min_nodes (after a snapshot) and, if still short, preempts them (they requeue)",
    )
    queue: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="the queue whose node quota the job counts against (the controller's --quotas); none: only "
        "the submitter's quota applies",
    )
    lr_policy: LRPolicySpec = Field(default_factory=lambda: LRPolicySpec())
    restart_policy: RestartPolicy = Field(default_factory=lambda: RestartPolicy())
    rendezvous: RendezvousOptions = Field(default_factory=lambda: RendezvousOptions())

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if value.strip() != value or "\0" in value:
            raise ValueError("must not start or end with spaces or contain NUL")
        return value

    @field_validator("max_nodes")
    @classmethod
    def _max_at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_nodes")
        if low is not None and value < low:
            raise ValueError(f"must be >= min_nodes ({low})")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if key in RESERVED_ENV or key.startswith(_RESERVED_ENV_PREFIXES):
                raise ValueError(f"{key!r} is set by the service and cannot be overridden")
        return value

    @field_validator("checkpoint_url")
    @classmethod
    def _checkpoint_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return normalize_checkpoint_url(value)


# etcd applies at most 128 operations per transaction; a pass may release a job's old nodes and assign as many
# new ones (plus its status and events) in one: 2 x 60 + 8 stays below.
MAX_NODES_PER_JOB = 60
#: a submitted spec's most bytes as JSON: a realistic one is about 1 KB; every assignment, status read and list of
#: jobs carries it, and a user may keep up to ``max_jobs`` of them (``SubmitLimits``) for the retention period
MAX_SPEC_BYTES = 64 * 1024
# etcd refuses requests over 1.5 MiB; every assignment carries the spec, so the spec times max_nodes must fit
_ASSIGNMENTS_BUDGET = 1 << 20
_ASSIGNMENT_OVERHEAD = 512


def submit_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """``(field, message)`` for what a new job may not ask although the model accepts it (stored jobs keep
    loading): limits the controller's etcd transactions must honour. Empty: the job can be scheduled."""
    unencodable = _unencodable_fields(spec.model_dump())
    if unencodable:  # nothing more can be checked (or stored, or passed to a process) of such a spec
        return [
            (
                field,
                "is not valid Unicode text (a lone surrogate such as \\ud800): it cannot be stored or "
                "passed to a process",
            )
            for field in unencodable
        ]
    problems = [
        (field, "contains a NUL byte, which no process can be given (arguments, environment and paths are C strings)")
        for field in _nul_fields(spec)
    ]
    size = len(spec.model_dump_json())
    if size > MAX_SPEC_BYTES:
        problems.append(
            (
                "spec",
                f"the spec is {size} bytes as JSON, more than the {MAX_SPEC_BYTES} a job may "
                "have: put large settings in a file under working_dir and pass its path",
            )
        )
    if spec.max_nodes > MAX_NODES_PER_JOB:
        problems.append(
            ("max_nodes", f"at most {MAX_NODES_PER_JOB} nodes per job (etcd's 128 operations per transaction)")
        )
    nodes = min(spec.max_nodes, MAX_NODES_PER_JOB)
    if nodes * (size + _ASSIGNMENT_OVERHEAD) > _ASSIGNMENTS_BUDGET:
        problems.append(
            (
                "env",
                f"the spec is {size} bytes; with max_nodes={spec.max_nodes} its assignments "
                f"would exceed {_ASSIGNMENTS_BUDGET} bytes in one etcd transaction: shrink env "
                "and args, or max_nodes",
            )
        )
    return problems


def _unencodable_fields(value: object, path: str = "") -> list[str]:
    """The fields (``env.X``, ``args.2``) of a dumped spec whose text UTF-8 cannot encode: JSON's ``\\ud800`` escapes
    give such strings, which every later serialization refused with an error (the submit answered 500)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return [path or "spec"]
        return []
    if isinstance(value, dict):
        return [
            f
            for k, v in value.items()
            for f in _unencodable_fields(k, path) + _unencodable_fields(v, f"{path}.{k}".lstrip("."))
        ]
    if isinstance(value, (list, tuple)):
        return [f for i, v in enumerate(value) for f in _unencodable_fields(v, f"{path}.{i}".lstrip("."))]
    return []


def _nul_fields(spec: JobSpec) -> list[str]:
    """The fields of ``spec`` that hold a NUL byte (``env.NAME``, ``args.3``, ...)."""
    found = [f"env.{k}" for k, v in spec.env.items() if "\0" in v]
    found += [f"args.{i}" for i, arg in enumerate(spec.args) if "\0" in arg]
    found += [name for name in ("working_dir", "image") if "\0" in (getattr(spec, name) or "")]
    return found


def normalize_checkpoint_url(value: str) -> str:
    """``/a/b/`` -> ``file:///a/b``; checks the scheme, refuses ``..`` segments and a ``file://`` URL naming
    another host, and (``file://``) collapses ``//`` and ``.`` segments as POSIX does."""
    url = value.strip()
    if url.startswith("/"):
        url = "file://" + url
    parsed = urlparse(url)
    if parsed.scheme not in _CHECKPOINT_SCHEMES:
        raise ValueError(
            f"must be an absolute path or a URL with one of the schemes {', '.join(_CHECKPOINT_SCHEMES)}"
            + (
                " (a Lustre file system is a mounted path: give the path or file:///...)"
                if parsed.scheme == "lustre"
                else ""
            )
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// URL names a path on every node, not host {parsed.netloc!r}: file:///...")
        if not parsed.path.startswith("/"):
            raise ValueError("a file:// URL needs an absolute path (file:///...)")
    if ".." in parsed.path.split("/"):
        raise ValueError("must not contain '..' segments")
    if parsed.scheme == "file":
        return "file://" + (_canonical_path(parsed.path) or "/")
    return url.rstrip("/") or url


def _canonical_path(path: str) -> str:
    """``/a//b/./c/`` -> ``/a/b/c``: empty and ``.`` segments dropped (``..`` is refused before)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return "/" + "/".join(parts) if parts else ""


def checkpoint_url_within(url: str, prefix: str) -> bool:
    """True if ``url`` is ``prefix`` or below it (segment-wise, after normalization; for every scheme empty
    and ``.`` path segments are ignored here, so that spellings of one location never pass for two)."""
    a, b = _comparable(url), _comparable(prefix)
    return a == b or a.startswith(b.rstrip("/") + "/")


def _comparable(url: str) -> str:
    parsed = urlparse(normalize_checkpoint_url(url))
    return f"{parsed.scheme}://{parsed.netloc.lower()}{_canonical_path(parsed.path)}"


def checkpoint_prefix_owner(url: str, claimed: Mapping[str, str], exclude: str | None = None) -> str | None:
    """The first job (by id) of ``claimed`` (job id -> checkpoint URL) whose prefix overlaps ``url``: one is
    within the other. ``exclude``: the asking job's own id. The one overlap rule of submit and reconcile."""
    for job_id, theirs in sorted(claimed.items()):
        if job_id != exclude and (checkpoint_url_within(url, theirs) or checkpoint_url_within(theirs, url)):
            return job_id
    return None


# -- records kept in etcd -----------------------------------------------------------------------------
