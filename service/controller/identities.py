"""Each job's own etcd identity: a user and a role that reach only the job's rendezvous and progress keys.

A job's torchrun and workers talk to etcd (the rendezvous, rank 0's progress reports). When the control plane
authenticates to etcd with a user and password, handing the jobs those credentials would let any job rewrite
every other job's state, the assignments and the leader key. Instead the leader gives each job, before the
job's first assignment is written, an etcd user ``etrain-job-<job id>`` with a random password and a role of
the same name granted:

* ``readwrite`` on every key under ``<prefix>.rdzv/<job id>.g``: the torchrun rendezvous of all the job's
  generations (run ids are ``<job id>.g<generation>``, ``service.core.models.rdzv_run_id``; the ``etcd-v3``
  backend keeps a run's state and store under ``<key_prefix>/<run id>/``, and the agents pass
  ``key_prefix=<prefix>.rdzv``). No job id holds a ``.``, so no other job's run falls under that prefix (with the
  former ``-g`` a job named ``<job id>-g...`` did);
* ``readwrite`` on ``<prefix>/progress/<job id>`` (rank 0's reports);
* ``read`` on the key ``"\\0"``, which the etcd client reads to check that etcd answers (nothing is kept
  there).

Leases need no grant (etcd lets any authenticated user grant and refresh one; revoking one needs write access
to the keys attached, which are the job's own).

Where things are: ``<prefix>/identities/<job id>`` holds the :class:`IdentityRecord` (user, password, whether
the user is made), a control-plane key that job users cannot read; each assignment carries the user and
password to the agents (``assign/`` is control-plane too). The agent writes the password to a 0600 file and
hands torchrun and the workers that user and file, never its own.

Crash safety: the leader writes the record (fenced) before it makes the role and user, and marks it ready
after; every step is idempotent (a role or user that exists is kept, its password set to the record's), so a
pass that dies anywhere is finished by the next one. Assignments are written only with a ready identity; a
stored user that vanished from etcd is made again when a leader starts. When
a job is terminal or gone, the leader deletes the user (its tokens stop working at once), then the role, then
the record. Users of ours without a record (a deposed leader's late write) are swept once per leadership term,
for jobs the view shows terminal; a user named for a job this service does not know is left alone, since
several services may share one etcd under different prefixes while etcd's user names are global.

:func:`decide_identities` and :func:`with_credentials` are pure; :class:`JobIdentities` applies them.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic.etcd import EtcdAuth, EtcdClient, EtcdConnectionError, EtcdError, auth_of
from elastic.etcd.api import RolePermission
from service.core.models import rdzv_runs_prefix
from service.core.store import Keys, ServiceStore, identities_prefix, identity_key
from service.core.view import ClusterView, Plan

logger = logging.getLogger(__name__)

__all__ = [
    "PING_KEY",
    "SHARED_IDENTITY_WARNING",
    "USER_PREFIX",
    "IdentityDecision",
    "IdentityRecord",
    "JobIdentities",
    "decide_identities",
    "job_permissions",
    "job_principal",
    "password_auth",
    "with_credentials",
]

USER_PREFIX = "etrain-job-"
PING_KEY = "\0"  # what the etcd client reads to check that etcd answers
SHARED_IDENTITY_WARNING = (
    "the control plane authenticates to etcd without a password user (no etcd auth, or client certificates "
    "only): jobs get its etcd identity, so any job can read and rewrite every job's state, the assignments "
    "and the leader key; for per-job isolation enable etcd auth and run the controller as an etcd user with "
    "a password and the root role (docs/service.md, 'Job identities in etcd')"
)


def job_principal(job_id: str) -> str:
    """The etcd user, and role, of one job."""
    return USER_PREFIX + job_id


def job_permissions(keys: Keys, job_id: str) -> tuple[RolePermission, ...]:
    """What a job's role may do (see the module docstring)."""
    return (
        RolePermission(f"{keys.rdzv}/{rdzv_runs_prefix(job_id)}", "readwrite", prefix=True),
        RolePermission(keys.progress_of(job_id), "readwrite"),
        RolePermission(PING_KEY, "read"),
    )


def password_auth(client: EtcdClient) -> bool:
    """Whether the control plane authenticates to etcd with a user and password (then jobs get their own)."""
    config = client.config
    return config.user is not None and config.password is not None


class IdentityRecord(BaseModel):
    """``<prefix>/identities/<job id>``: one job's etcd user; ``ready`` once the user and role are made."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    user: str
    password: str = Field(repr=False)
    ready: bool = False
    created_at: datetime


@dataclass(frozen=True)
class IdentityDecision:
    """``ensure``: jobs that need their identity made (or finished) before this pass's assignments are
    written; ``revoke``: jobs whose identity must go. Job ids, sorted."""

    ensure: tuple[str, ...] = ()
    revoke: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ensure and not self.revoke


def _terminal_after(view: ClusterView, plan: Plan) -> set[str]:
    """Jobs terminal once ``plan`` is applied (its new status, else the view's), purged ones included."""
    out = {j for j, e in view.jobs.items() if e.status.state.terminal}
    for u in plan.updates:
        if u.status is not None and u.status.state.terminal:
            out.add(u.job_id)
        elif u.status is not None:
            out.discard(u.job_id)
        if u.purge:
            out.add(u.job_id)
    return out


def decide_identities(
    view: ClusterView, plan: Plan, records: Mapping[str, IdentityRecord], users: Iterable[str] | None = None
) -> IdentityDecision:
    """Which identities to make and which to revoke in this pass.

    ``records``: the stored identities by job id; ``users``: etcd's user names when listed (once per
    leadership term), else None. Ensure: jobs the plan assigns nodes to whose identity is not ready, and,
    from ``users``, active jobs whose stored user is missing from etcd (made again with the stored password,
    which their agents hold). Revoke: jobs with a record that are terminal (after the plan) or no longer
    known, and, from ``users``, jobs terminal in the view that still have a user of ours without a record.
    """
    terminal = _terminal_after(view, plan)
    placing = {u.job_id for u in plan.updates if u.assign and u.job_id not in terminal}
    ensure = {j for j in placing if not ((rec := records.get(j)) is not None and rec.ready)}
    revoke = {j for j in records if j in terminal or j not in view.jobs}
    if users is not None:
        listed = set(users)
        ensure |= {j for j, rec in records.items() if j in view.jobs and j not in terminal and rec.user not in listed}
        for user in listed:
            job_id = user.removeprefix(USER_PREFIX)
            if user.startswith(USER_PREFIX) and job_id in view.jobs and job_id in terminal:
                revoke.add(job_id)
    return IdentityDecision(ensure=tuple(sorted(ensure)), revoke=tuple(sorted(revoke - ensure)))


def with_credentials(plan: Plan, records: Mapping[str, IdentityRecord]) -> tuple[Plan, list[str]]:
    """``plan`` with each assignment carrying its job's user and password; a job's update that assigns
    nodes without a ready identity is held back (it is decided again next pass). Returns the plan and the
    job ids held back."""
    updates, held = [], []
    for u in plan.updates:
        if not u.assign:
            updates.append(u)
            continue
        rec = records.get(u.job_id)
        if rec is None or not rec.ready:
            held.append(u.job_id)
            continue
        creds = {"etcd_user": rec.user, "etcd_password": rec.password}
        updates.append(replace(u, assign={n: a.model_copy(update=creds) for n, a in u.assign.items()}))
    return Plan(updates=updates, orphans=list(plan.orphans)), held


class _Refused(Exception):
    """A fenced write of the identity record was refused: leadership lost (or a concurrent writer)."""


def _new_password() -> str:
    return secrets.token_urlsafe(32)


class JobIdentities:
    """Makes and revokes the jobs' etcd identities for the leader (see the module docstring).

    ``prepare`` runs once per reconcile pass, between deciding and applying the plan.
    """

    def __init__(self, store: ServiceStore, new_password: Callable[[], str] = _new_password) -> None:
        self._store = store
        self._client = store.client
        self._auth: EtcdAuth = auth_of(store.client)  # the same client, its users and roles
        self._keys = store.keys
        self._new_password = new_password
        self._swept: tuple[str, int] | None = None  # the leadership term whose users were listed

    def check(self) -> None:
        """Log, at start-up, whether the controller's etcd user may manage users (it needs the root role)."""
        try:
            self._auth.user_list()
        except EtcdConnectionError as exc:
            logger.warning("cannot check the controller's etcd permissions yet: %s", exc)
        except EtcdError as exc:
            logger.error(
                "the controller's etcd user %r cannot manage etcd users (%s): it needs the root role, else "
                "no job can get an etcd identity of its own and none will start",
                self._client.config.user,
                exc,
            )

    def read(self) -> dict[str, IdentityRecord]:
        """The stored identities by job id (unreadable records are skipped with a warning)."""
        prefix = identities_prefix(self._keys)
        kvs, _ = self._client.get_prefix(prefix)
        out = {}
        for kv in kvs:
            try:
                out[kv.key[len(prefix) :]] = IdentityRecord.model_validate_json(kv.value)
            except ValidationError as exc:
                logger.warning("ignoring unreadable job identity at %s: %s", kv.key, exc.errors()[:1])
        return out

    def _users_once(self, fence: tuple[str, int]) -> list[str] | None:
        if self._swept == fence:
            return None
        self._swept = fence
        try:
            return self._auth.user_list()
        except EtcdConnectionError:
            self._swept = None
            raise
        except EtcdError as exc:
            logger.error("cannot list etcd users (the controller's etcd user needs the root role): %s", exc)
            return None

    def prepare(self, view: ClusterView, plan: Plan, fence: tuple[str, int], now: datetime) -> Plan:
        """Make the identities ``plan``'s assignments need and revoke those of finished jobs; return the
        plan with credentials in its assignments (updates of jobs without an identity held back).

        Raises :class:`EtcdConnectionError` when etcd does not answer (the pass fails as a whole)."""
        records = self.read()
        decision = decide_identities(view, plan, records, self._users_once(fence))
        for job_id in decision.ensure:
            try:
                records[job_id] = self._ensure(job_id, records.get(job_id), fence, now)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                logger.warning("job %s: cannot make its etcd identity, not assigning it yet: %s", job_id, exc)
            except _Refused:
                logger.info("job %s: identity record not written (leadership lost?)", job_id)
        for job_id in decision.revoke:
            try:
                self._revoke(job_id, records.get(job_id), fence)
            except EtcdConnectionError:
                raise
            except EtcdError as exc:
                logger.warning("job %s: cannot revoke its etcd identity yet: %s", job_id, exc)
        planned, held = with_credentials(plan, records)
        for job_id in held:
            logger.info("job %s: assignment held back until its etcd identity exists", job_id)
        return planned

    def _put(self, record: IdentityRecord, fence: tuple[str, int], *, new: bool) -> None:
        key = identity_key(self._keys, record.job_id)
        ok, _ = self._client.commit(
            puts=[(key, record.model_dump_json().encode())], expect=[(key, 0)] if new else [], guard=fence
        )
        if not ok:
            raise _Refused(record.job_id)

    def _ensure(
        self, job_id: str, record: IdentityRecord | None, fence: tuple[str, int], now: datetime
    ) -> IdentityRecord:
        """Make (or finish making) the job's role and user; returns the ready record."""
        if record is None:
            name = job_principal(job_id)
            record = IdentityRecord(job_id=job_id, user=name, password=self._new_password(), created_at=now)
            self._put(record, fence, new=True)  # first: a crash from here on is finished by the next pass
        role = job_principal(job_id)
        self._auth.role_add(role)
        for permission in job_permissions(self._keys, job_id):
            self._auth.role_grant_permission(role, permission)
        if not self._auth.user_add(record.user, record.password):
            self._auth.user_change_password(record.user, record.password)  # made by a pass that died
        self._auth.user_grant_role(record.user, role)
        ready = record.model_copy(update={"ready": True})
        self._put(ready, fence, new=False)
        logger.info("job %s: etcd user %s made (its rendezvous and progress keys only)", job_id, record.user)
        return ready

    def _revoke(self, job_id: str, record: IdentityRecord | None, fence: tuple[str, int]) -> None:
        user = record.user if record is not None else job_principal(job_id)
        gone = self._auth.user_delete(user)
        self._auth.role_delete(job_principal(job_id))
        self._client.commit(deletes=[identity_key(self._keys, job_id)], guard=fence)
        if gone:
            logger.info("job %s: etcd user %s revoked", job_id, user)
