"""Settings of the controller and of the node agent, built by the CLI (or tests) and passed in.

Nothing here connects anywhere; building settings only reads the tokens file. The etcd connection is an
:class:`elastic.etcd.config.EtcdOptions` (the library's: the same for controller, agents, torchrun's
rendezvous and the workers); its ``config()`` reads the password file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from elastic.etcd.config import EtcdOptions  # the settings' etcd connection (re-exported: one class)
from service.core.keys import DEFAULT_PREFIX
from service.core.models import NAME_PATTERN
from service.core.view import Quotas, ReconcileConfig, SubmitLimits

logger = logging.getLogger(__name__)

__all__ = [
    "AgentSettings",
    "ConfigError",
    "EtcdOptions",
    "Role",
    "Settings",
    "TokenEntry",
    "UidRange",
    "load_quotas",
    "load_tokens",
]


class ConfigError(ValueError):
    """Settings that cannot work (a bad tokens file, a missing password file); the message is one line."""


class Role(str, Enum):
    """What a token may do (``service.api.auth``)."""

    #: an operator: everything, on every job and node
    ADMIN = "admin"
    #: submit jobs (within the quotas file's ``limits``); resize, cancel and read the logs of its own jobs
    USER = "user"
    #: status only: no logs, no env values, no args
    READ = "read"


@dataclass(frozen=True)
class TokenEntry:
    token: str
    role: Role
    name: str


@dataclass(frozen=True)
class UidRange:
    """Uids (and gids of the same numbers) ``low..high``, both included, for jobs' processes."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high < 2**31:
            raise ValueError(f"a uid range must be LOW-HIGH with 1 <= LOW <= HIGH < 2^31, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str) -> UidRange:
        """``"20000-29999"``; ValueError (one line) otherwise."""
        low, sep, high = text.strip().partition("-")
        if not sep or not (low + high).isascii() or not low.isdigit() or not high.isdigit():
            raise ValueError(f"a uid range is LOW-HIGH (e.g. 20000-29999), got {text!r}")
        return cls(int(low), int(high))

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.low <= uid <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Settings:
    """The controller: REST API plus (on the elected replica) the reconcile loop."""

    etcd: EtcdOptions
    prefix: str = DEFAULT_PREFIX
    host: str = "0.0.0.0"
    port: int = 8080
    tokens: tuple[TokenEntry, ...] | None = None  # None: authentication off
    checkpoint_root: str | None = None  # jobs' checkpoint URLs must lie below it; default <root>/<job id>
    leader_ttl: timedelta = timedelta(seconds=5)
    reconcile_interval: timedelta = timedelta(seconds=1)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    replica_id: str = field(default_factory=_default_replica_id)
    run_controller: bool = True  # False: serve the API only, never campaign for leadership
    # how often the leader writes the jobs' metric series to etcd (service.core.metric_store): batched
    metrics_flush_interval: timedelta = timedelta(seconds=5)


@dataclass(frozen=True)
class AgentSettings:
    """One node agent: registers ``node_name`` and runs torchrun for the jobs assigned to it."""

    etcd: EtcdOptions
    node_name: str
    prefix: str = DEFAULT_PREFIX
    nproc_per_node: int = 1
    work_dir: Path = Path("etrain-work")
    rdzv_host: str | None = None
    socket_ifname: str | None = None  # the workers' GLOO_/NCCL_SOCKET_IFNAME unless the job's env sets them
    health_port: int = 0
    spare: bool = False  # a hot spare: held back for jobs that lost a node, its zygote warm (torch imported)
    # the job-log server (service.agent.logs), which the controller proxies ``GET /v1/jobs/{id}/logs`` to;
    # 0: off. ``logs_host`` is the address it binds.
    logs_port: int = 0
    logs_host: str = "0.0.0.0"
    lease_ttl: timedelta = timedelta(seconds=10)
    poll_interval: timedelta = timedelta(seconds=0.5)
    stop_grace: timedelta = timedelta(seconds=15)
    python: str = sys.executable
    extra_env: Mapping[str, str] = field(default_factory=dict)  # added to every worker's environment
    # each job's torchrun runs as a uid (and gid) of its own from this range (service.agent.isolation); None: as
    # the agent's uid
    job_uid_range: UidRange | None = None
    # the one owner (a token's name) whose jobs this node runs, when jobs share the agent's uid
    job_owner: str | None = None
    # with job_uid_range: where a released uid's own files and directories (top level) are deleted
    job_tmp_dirs: tuple[Path, ...] = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


def _parse_tokens(data: Any, source: str) -> tuple[TokenEntry, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise ConfigError(f"{source}: expected a mapping with a 'tokens' list")
    out: list[TokenEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(data["tokens"]):
        if not isinstance(item, dict):
            raise ConfigError(f"{source}: tokens[{i}] is not a mapping")
        token, role, name = item.get("token"), item.get("role"), item.get("name") or f"token-{i}"
        if not isinstance(token, str) or not token.strip():
            raise ConfigError(f"{source}: tokens[{i}].token must be a non-empty string")
        try:
            parsed_role = Role(role)
        except ValueError:
            raise ConfigError(f"{source}: tokens[{i}].role must be 'admin', 'user' or 'read', got {role!r}") from None
        if token in seen:
            raise ConfigError(f"{source}: tokens[{i}] repeats a token")
        if len(token) < 16:
            logger.warning("%s: token %r is shorter than 16 characters", source, name)
        seen.add(token)
        out.append(TokenEntry(token=token, role=parsed_role, name=str(name)))
    if not out:
        raise ConfigError(f"{source}: no tokens (remove --tokens-file to turn authentication off)")
    return tuple(out)


def _read_config_file(path: str | Path, what: str) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc}") from exc
    try:
        return json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from exc


def load_tokens(path: str | Path) -> tuple[TokenEntry, ...]:
    """Read ``{tokens: [{token, role: admin|user|read, name}]}`` from a YAML or JSON file."""
    return _parse_tokens(_read_config_file(path, "tokens"), str(path))


_QUOTA_KEYS = ("users", "queues", "default_user", "limits")
_LIMIT_KEYS = ("max_priority", "queues", "max_pending", "max_jobs")
_QUEUE_NAME = re.compile(NAME_PATTERN)


def _quota(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a whole number of nodes >= 0, got {value!r}")
    return value


def _quota_map(data: Any, key: str, source: str) -> dict[str, int]:
    table = data.get(key)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {key} must be a mapping of name to a number of nodes")
    out: dict[str, int] = {}
    for name, value in table.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{source}: {key}: the name {name!r} is not a non-empty string")
        if key == "queues" and not _QUEUE_NAME.match(name):
            raise ConfigError(
                f"{source}: queues.{name}: not a queue name a job can give (lower-case letters, "
                "digits, '-', at most 40)"
            )
        out[name] = _quota(value, f"{source}: {key}.{name}")
    return out


def _limits(data: Any, where: str) -> SubmitLimits:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with max_priority, queues, max_pending and/or max_jobs")
    unknown = sorted(str(k) for k in data if k not in _LIMIT_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (expected {', '.join(_LIMIT_KEYS)})")
    prio, queues, pending = data.get("max_priority"), data.get("queues"), data.get("max_pending")
    if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int) or not -1000 <= prio <= 1000):
        raise ConfigError(f"{where}.max_priority must be a whole number from -1000 to 1000, got {prio!r}")
    if queues is not None:
        if not isinstance(queues, list) or not all(isinstance(q, str) and _QUEUE_NAME.match(q) for q in queues):
            raise ConfigError(f"{where}.queues must be a list of queue names, got {queues!r}")
    if pending is not None and (isinstance(pending, bool) or not isinstance(pending, int) or pending < 0):
        raise ConfigError(f"{where}.max_pending must be a whole number >= 0, got {pending!r}")
    stored = data.get("max_jobs")
    if stored is not None and (isinstance(stored, bool) or not isinstance(stored, int) or stored < 0):
        raise ConfigError(f"{where}.max_jobs must be a whole number >= 0, got {stored!r}")
    return SubmitLimits(
        max_priority=prio, queues=None if queues is None else frozenset(queues), max_pending=pending, max_jobs=stored
    )


def _parse_limits(data: Any, source: str) -> tuple[dict[str, SubmitLimits], SubmitLimits]:
    if data is None:
        return {}, SubmitLimits()
    if not isinstance(data, dict) or any(k not in ("default", "users") for k in data):
        raise ConfigError(f"{source}: limits must be a mapping with default and/or users")
    users = data.get("users") or {}
    if not isinstance(users, dict) or not all(isinstance(n, str) and n.strip() for n in users):
        raise ConfigError(f"{source}: limits.users must be a mapping of user name to limits")
    default = _limits(data["default"], f"{source}: limits.default") if "default" in data else SubmitLimits()
    return {n: _limits(v, f"{source}: limits.users.{n}") for n, v in users.items()}, default


def _parse_quotas(data: Any, source: str) -> Quotas:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with users, queues and/or default_user")
    unknown = sorted(str(k) for k in data if k not in _QUOTA_KEYS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)} (expected users, queues, default_user, limits)"
        )
    default = data.get("default_user")
    limits, default_limits = _parse_limits(data.get("limits"), source)
    return Quotas(
        limits=limits,
        default_limits=default_limits,
        users=_quota_map(data, "users", source),
        queues=_quota_map(data, "queues", source),
        default_user=None if default is None else _quota(default, f"{source}: default_user"),
    )


def load_quotas(path: str | Path) -> Quotas:
    """Read the node quotas ``{users: {NAME: N}, queues: {QUEUE: N}, default_user: N}`` (each part optional; N:
    nodes held at once by the active jobs of that user or queue, >= 0) from a YAML or JSON file. A user is
    a token's name (``--tokens-file``); one not listed gets ``default_user`` (absent: no limit). ``limits:
    {default: L, users: {NAME: L}}`` bounds what ``user`` tokens submit, ``L`` being ``{max_priority: P, queues:
    [QUEUE, ...], max_pending: N}`` (each optional; a user's unset ones from ``default``, those still unset:
    ``service.core.jobs.UNGRANTED_LIMITS``, priority 0 at most and no queue)."""
    return _parse_quotas(_read_config_file(path, "quotas"), str(path))
