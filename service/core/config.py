"""Settings of the controller and of the node agent, built by the CLI (or tests) and passed in.

Nothing here connects anywhere; building settings only reads the tokens file. The etcd connection is an
:class:`elastic.etcd.config.EtcdOptions` (the library's: the same for controller, agents, torchrun's
rendezvous and the workers); its ``config()`` reads the password file.
"""

from __future__ import annotations

import json
import logging
import os
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
from service.core.view import ReconcileConfig

logger = logging.getLogger(__name__)

__all__ = [
    "AgentSettings",
    "ConfigError",
    "EtcdOptions",
    "Role",
    "Settings",
    "TokenEntry",
    "load_tokens",
]


class ConfigError(ValueError):
    """Settings that cannot work (a bad tokens file, a missing password file); the message is one line."""


class Role(str, Enum):
    ADMIN = "admin"
    READ = "read"


@dataclass(frozen=True)
class TokenEntry:
    token: str
    role: Role
    name: str


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Settings:
    """The controller: REST API plus (on the elected replica) the reconcile loop."""

    etcd: EtcdOptions
    prefix: str = "/etrain"
    host: str = "0.0.0.0"
    port: int = 8080
    tokens: tuple[TokenEntry, ...] | None = None  # None: authentication off
    checkpoint_root: str | None = None  # jobs' checkpoint URLs must lie below it; default <root>/<job id>
    leader_ttl: timedelta = timedelta(seconds=5)
    reconcile_interval: timedelta = timedelta(seconds=1)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    replica_id: str = field(default_factory=_default_replica_id)
    run_controller: bool = True  # False: serve the API only, never campaign for leadership


@dataclass(frozen=True)
class AgentSettings:
    """One node agent: registers ``node_name`` and runs torchrun for the jobs assigned to it."""

    etcd: EtcdOptions
    node_name: str
    prefix: str = "/etrain"
    nproc_per_node: int = 1
    work_dir: Path = Path("etrain-work")
    rdzv_host: str | None = None
    socket_ifname: str | None = None  # the workers' GLOO_/NCCL_SOCKET_IFNAME unless the job's env sets them
    health_port: int = 0
    lease_ttl: timedelta = timedelta(seconds=10)
    poll_interval: timedelta = timedelta(seconds=0.5)
    stop_grace: timedelta = timedelta(seconds=15)
    python: str = sys.executable
    extra_env: Mapping[str, str] = field(default_factory=dict)  # added to every worker's environment


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
            raise ConfigError(f"{source}: tokens[{i}].role must be 'admin' or 'read', got {role!r}") from None
        if token in seen:
            raise ConfigError(f"{source}: tokens[{i}] repeats a token")
        if len(token) < 16:
            logger.warning("%s: token %r is shorter than 16 characters", source, name)
        seen.add(token)
        out.append(TokenEntry(token=token, role=parsed_role, name=str(name)))
    if not out:
        raise ConfigError(f"{source}: no tokens (remove --tokens-file to turn authentication off)")
    return tuple(out)


def load_tokens(path: str | Path) -> tuple[TokenEntry, ...]:
    """Read ``{tokens: [{token, role: admin|read, name}]}`` from a YAML or JSON file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the tokens file {path}: {exc}") from exc
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from exc
    return _parse_tokens(data, str(path))
