"""Users in an etcd that has none yet: ``root``, the agents' own user, then etcd's authentication turned on.

The Helm chart's in-cluster etcd starts without users; its controller pod runs ``etrain etcd-bootstrap`` as an
init container before the controller. What it does is idempotent and safe to run from several replicas at once:

- **auth off** (a request without a user is answered): make ``root`` (with the ``root`` role and the given
  password) and the agents' user and role, then turn authentication on;
- **auth on**: log in as ``root`` and make sure of the agents' user and role again, with the password now
  given (so a changed Secret takes effect on the next start).

The agents' user holds :func:`agent_permissions` only: the service's keys and the jobs' rendezvous keys, but
no user management; jobs get users of their own from the controller (:mod:`service.controller.identities`), so
after this no process in the release but the controller holds ``root``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from enum import Enum

from elastic.etcd import EtcdConnectionError, EtcdError, create_client
from elastic.etcd.api import RolePermission
from elastic.etcd.client import GrpcEtcdClient
from elastic.etcd.config import EtcdConfig
from service.controller.identities import PING_KEY
from service.core.keys import Keys

__all__ = [
    "AGENT_ROLE",
    "ROOT",
    "AuthBootstrap",
    "BootstrapError",
    "BootstrapOutcome",
    "agent_permissions",
    "bootstrap_etcd_auth",
]

logger = logging.getLogger(__name__)

ROOT = "root"  # etcd's superuser and its role: AuthEnable requires a user "root" holding the role "root"
AGENT_ROLE = "etrain-agent"


class BootstrapError(EtcdError):
    """etcd's users could not be set up (the reason is in the message)."""


class BootstrapOutcome(str, Enum):
    ENABLED = "enabled"  # authentication was off: the users were made and it is on now
    CONFIRMED = "confirmed"  # it was on already: the agents' user and role were made sure of


@dataclass(frozen=True)
class AuthBootstrap:
    """What to set up: ``root``'s password, the agents' user and password, the service's key prefix."""

    root_password: str = field(repr=False)
    agent_user: str
    agent_password: str = field(repr=False)
    prefix: str

    def __post_init__(self) -> None:
        if not self.root_password or not self.agent_password:
            raise ValueError("etcd bootstrap: the root and agent passwords must not be empty")
        if not self.agent_user or self.agent_user == ROOT:
            raise ValueError(f"etcd bootstrap: the agents' user must be a name other than {ROOT!r}")


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
                logger.info("etcd authentication turned on; users %s and %s made", ROOT, plan.agent_user)
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
        logger.info("etcd authentication was on; user %s and role %s confirmed", plan.agent_user, AGENT_ROLE)
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
    client.role_add(AGENT_ROLE)
    for permission in agent_permissions(plan.prefix):
        client.role_grant_permission(AGENT_ROLE, permission)
    if not client.user_add(plan.agent_user, plan.agent_password):
        client.user_change_password(plan.agent_user, plan.agent_password)
    client.user_grant_role(plan.agent_user, AGENT_ROLE)
