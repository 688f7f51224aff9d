"""Users in an etcd that has none yet: ``root``, the agents' own user, then etcd's authentication turned on.

The Helm chart's in-cluster etcd starts without users; its controller pod runs ``etrain etcd-bootstrap`` as an
init container before the controller. What it does is idempotent and safe to run from several replicas at once:

- **auth off** (a request without a user is answered): make ``root`` (with the ``root`` role and the given
  password) and the agents' user and role, then turn authentication on;
- **auth on**: log in as ``root`` and make sure of the agents' user and role again, with the password now
  given (so a changed Secret takes effect on the next start).

**One etcd user per node** (``nodes``: ``etrain-node-<name>``, with a role of the same name) holds
:func:`node_permissions` only: its own node record, its own assignments (read), its own worker reports. It cannot
read another node's assignments (each carries its job's spec, env secrets and etcd password), ``jobs/``,
``status/`` or ``identities/``, and cannot write anything the leader schedules from; its jobs reach etcd as their own
users (:mod:`service.controller.identities`). ``remove_nodes`` deletes a node's user and role (its tokens stop
working at once). The **shared agents' user** (``agent_user``) is the former way: every agent holding it reads and
writes all of the service's keys, so one compromised node controls the service; it is made only when asked for.

Every role is set to exactly its permissions: a grant left from an earlier run (another ``--prefix``) is taken back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from elastic.etcd import EtcdConnectionError, EtcdError, create_client
from elastic.etcd.api import RolePermission
from elastic.etcd.client import GrpcEtcdClient
from elastic.etcd.config import EtcdConfig
from service.controller.identities import PING_KEY
from service.core.keys import Keys
from service.core.spec import NODE_NAME_PATTERN

__all__ = [
    "AGENT_ROLE",
    "NODE_USER_PREFIX",
    "ROOT",
    "AuthBootstrap",
    "BootstrapError",
    "BootstrapOutcome",
    "agent_permissions",
    "bootstrap_etcd_auth",
    "node_password",
    "node_permissions",
    "node_principal",
]

logger = logging.getLogger(__name__)

_NODE_NAME = re.compile(NODE_NAME_PATTERN)

ROOT = "root"  # etcd's superuser and its role: AuthEnable requires a user "root" holding the role "root"
AGENT_ROLE = "etrain-agent"
NODE_USER_PREFIX = "etrain-node-"


class BootstrapError(EtcdError):
    """etcd's users could not be set up (the reason is in the message)."""


class BootstrapOutcome(str, Enum):
    ENABLED = "enabled"  # authentication was off: the users were made and it is on now
    CONFIRMED = "confirmed"  # it was on already: the agents' user and role were made sure of


@dataclass(frozen=True)
class AuthBootstrap:
    """What to set up: ``root``'s password, the agents' user and password, the service's key prefix."""

    root_password: str = field(repr=False)
    agent_user: str | None  # None: no shared agents' user (each node has its own, ``nodes``)
    agent_password: str | None = field(repr=False)
    prefix: str
    nodes: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # (node name, its password)
    remove_nodes: tuple[str, ...] = ()
    prune_nodes: bool = False  # also remove each node user of ours that ``nodes`` leaves out (one service's etcd)

    def __post_init__(self) -> None:
        if not self.root_password:
            raise ValueError("etcd bootstrap: root's password must not be empty")
        if self.agent_user is not None and (not self.agent_user or self.agent_user == ROOT or not self.agent_password):
            raise ValueError(f"etcd bootstrap: the agents' user must be a name other than {ROOT!r}, with a password")
        for name, password in self.nodes:
            if not _NODE_NAME.fullmatch(name) or not password:
                raise ValueError(f"etcd bootstrap: node {name!r}: a valid node name and a password are needed")
        both = {n for n, _ in self.nodes} & set(self.remove_nodes)
        if both:
            raise ValueError(f"etcd bootstrap: nodes both made and removed: {', '.join(sorted(both))}")


def node_principal(node: str) -> str:
    """The etcd user, and role, of one node's agent."""
    return NODE_USER_PREFIX + node


def node_password(directory: Path, node: str) -> str:
    """The password of ``node``'s etcd user from ``directory/<node>``; a random one is made there first (0600, never
    through a link) when the file does not exist."""
    path = directory / node
    if not path.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another bootstrap made it meanwhile: read that one
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(24) + "\n")
    password = path.read_text().strip()
    if not password:
        raise ValueError(f"etcd bootstrap: the password file {path} is empty")
    return password


def node_permissions(prefix: str, node: str) -> tuple[RolePermission, ...]:
    """What one node's agent may do: its node record (on its lease), read its assignments, write its worker reports,
    and read the key a client pings."""
    keys = Keys(prefix)
    return (
        RolePermission(keys.node(node), "readwrite"),
        RolePermission(keys.assignments_of(node), "read", prefix=True),
        RolePermission(keys.reports_by(node), "readwrite", prefix=True),
        RolePermission(PING_KEY, "read"),
    )


def agent_permissions(prefix: str) -> tuple[RolePermission, ...]:
    """What the agents' role may do: read and write the service's keys (``<prefix>/``: nodes, assignments,
    reports, jobs' records) and the jobs' rendezvous (``<prefix>.rdzv/``), and read the key a client pings."""
    keys = Keys(prefix)
    return (
        RolePermission(keys.root + "/", "readwrite", prefix=True),
        RolePermission(keys.rdzv + "/", "readwrite", prefix=True),
        RolePermission(PING_KEY, "read"),
    )


def bootstrap_etcd_auth(config: EtcdConfig, plan: AuthBootstrap) -> BootstrapOutcome:
    """Set up etcd's users as the module docstring says. ``config``: the connection (TLS required, as for any
    password); its own user and password are ignored. Raises :class:`BootstrapError` with the reason, or
    :class:`EtcdConnectionError` when etcd cannot be reached."""
    if config.ca_cert is None:
        raise BootstrapError("etcd bootstrap: passwords need TLS to etcd (give its CA certificate)")
    anonymous = create_client(dataclasses.replace(config, user=None, password=None))
    try:
        auth_on = _auth_enabled(anonymous)
        if not auth_on:
            try:
                _ensure(anonymous, plan, set_root_password=True)
                anonymous.auth_enable()
                logger.info(
                    "etcd authentication turned on; users %s, %s and %d node user(s) made",
                    ROOT,
                    plan.agent_user or "(no shared agents user)",
                    len(plan.nodes),
                )
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                # Another replica turned it on midway (its requests without a user are refused now): the root
                # path below finishes the work; anything else is a real failure.
                if not _auth_enabled(anonymous):
                    raise BootstrapError(f"etcd bootstrap: setting up users failed: {exc}") from exc
                logger.info("etcd authentication was turned on by another bootstrap meanwhile")
    finally:
        anonymous.close()
    root = create_client(dataclasses.replace(config, user=ROOT, password=plan.root_password))
    try:
        try:
            _ensure(root, plan, set_root_password=False)
        except EtcdConnectionError:
            raise
        except EtcdError as exc:
            raise BootstrapError(
                f"etcd bootstrap: authentication is on but {ROOT!r} cannot manage users with the given password "
                f"(a different one set earlier?): {exc}"
            ) from exc
    finally:
        root.close()
    if auth_on:
        logger.info("etcd authentication was on; users and roles confirmed")
        return BootstrapOutcome.CONFIRMED
    return BootstrapOutcome.ENABLED


def _auth_enabled(client: GrpcEtcdClient) -> bool:
    """etcd refuses to list users to a request without a user exactly when its authentication is on."""
    try:
        client.user_list()
    except EtcdConnectionError:
        raise
    except EtcdError:
        return True
    return False


def _ensure(client: GrpcEtcdClient, plan: AuthBootstrap, *, set_root_password: bool) -> None:
    if not client.user_add(ROOT, plan.root_password) and set_root_password:
        client.user_change_password(ROOT, plan.root_password)
    client.role_add(ROOT)
    client.user_grant_role(ROOT, ROOT)
    if plan.agent_user is not None and plan.agent_password is not None:
        logger.warning(
            "etcd bootstrap: the shared agents' user %s reads and writes all of the service's keys (every "
            "job's secrets included): give each node a user of its own (--node)",
            plan.agent_user,
        )
        _ensure_user(client, plan.agent_user, plan.agent_password, AGENT_ROLE, agent_permissions(plan.prefix))
    for node, password in plan.nodes:
        principal = node_principal(node)
        _ensure_user(client, principal, password, principal, node_permissions(plan.prefix, node))
    removed = set(plan.remove_nodes)
    if plan.prune_nodes:
        kept = {node_principal(n) for n, _ in plan.nodes}
        removed |= {
            u[len(NODE_USER_PREFIX) :] for u in client.user_list() if u.startswith(NODE_USER_PREFIX) and u not in kept
        }
    for node in sorted(removed):
        principal = node_principal(node)
        client.user_delete(principal)
        client.role_delete(principal)
        logger.info("etcd bootstrap: node user %s removed", principal)


def _ensure_user(
    client: GrpcEtcdClient, user: str, password: str, role: str, permissions: tuple[RolePermission, ...]
) -> None:
    """``user`` with ``password`` holds ``role``, whose permissions are exactly ``permissions``: a grant of an
    earlier run (another prefix) is taken back after the new ones are in."""
    client.role_add(role)
    for permission in permissions:
        client.role_grant_permission(role, permission)
    wanted = {(p.key, p.prefix) for p in permissions}
    for stale in client.role_permissions(role):
        if (stale.key, stale.prefix) not in wanted:
            client.role_revoke_permission(role, stale.key, stale.prefix)
            logger.info(
                "etcd bootstrap: role %s no longer may %s %s%s",
                role,
                stale.perm,
                stale.key,
                "*" if stale.prefix else "",
            )
    if not client.user_add(user, password):
        client.user_change_password(user, password)
    client.user_grant_role(user, role)
