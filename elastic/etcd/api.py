"""The etcd v3 operations the project needs, as an interface, with the types and errors they use.

:class:`EtcdClient` (keys, leases, watches, transactions) is what the rest of the project (the rendezvous
backend, the store, the service) holds; :class:`EtcdAuth` (users and roles) is what only the controller's job
identities (``service.controller.identities``) need. Two implementations keep both contracts:
:class:`~elastic.etcd.client.GrpcEtcdClient` talks to a real cluster through ``python3-etcd3``,
:class:`~elastic.etcd.memory.MemoryEtcdClient` models one in memory for unit tests.
``tests/elastic/etcd/test_client_contract.py`` runs one suite against both. Both build on
:class:`TxnEtcdClient`, which writes the convenience transactions (``compare_and_put``, ``commit``,
``get_with_prefix``, ``read_prefixes``) once, over :meth:`EtcdClient.txn`.

Semantics shared by every implementation (they are etcd's own):

* The cluster has one revision counter. Every request that changes something (a put, a delete that
  deletes, a transaction whose applied branch writes, a lease revoked or expired with keys attached)
  raises it by exactly one; reads and writes that change nothing leave it. Each read returns the
  revision it was made at.
* A key has a *create revision* (when it was last created), a *mod revision* (when it was last written)
  and a *version* (writes since it was created); a missing key has all three 0.
* A *prefix* stands for every key that starts with it (``"/a/"`` covers ``"/a/x"`` but not ``"/a"`` or
  ``"/a0"``). Keys are compared as UTF-8 bytes and returned in that order. Empty keys and prefixes are
  refused with :class:`EtcdError`.
* A lease dies when it is revoked or when its TTL passes without a refresh; every key attached to it is
  deleted then, in one revision. Writing a key without a lease detaches it.
* Users and roles (:class:`EtcdAuth`) live beside the keys, not in them: managing them changes no revision.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from elastic.etcd.config import EtcdConfig
from elastic.etcd.txn import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    GetOp,
    GetResult,
    PutOp,
    TxnOp,
    TxnResult,
)
from elastic.etcd.types import KeyValue

__all__ = [
    "READ_PAGE_KEYS",
    "EtcdAuth",
    "EtcdClient",
    "EtcdClientClosedError",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseNotFoundError",
    "EtcdResponseTooLargeError",
    "KeyValue",
    "Permission",
    "RolePermission",
    "TxnEtcdClient",
    "auth_of",
    "prefix_end",
]


class EtcdError(Exception):
    """An etcd request failed for a reason other than connectivity (bad auth, bad request, unknown lease)."""


class EtcdConnectionError(EtcdError):
    """No configured etcd endpoint answered within the deadline."""


class EtcdClientClosedError(EtcdConnectionError):
    """The client was closed (:meth:`EtcdClient.close`): it never reconnects, so a thread still using it cannot
    re-open a connection nobody would close."""


class EtcdLeaseNotFoundError(EtcdError):
    """A write named a lease that is not live (it expired or was revoked): the request was not applied."""


class EtcdResponseTooLargeError(EtcdError):
    """The answer was larger than the client may receive (gRPC's limit, 4 MiB by default): nothing was lost, ask
    for less (a smaller page)."""


class EtcdCompactedError(EtcdError):
    """A read at an old revision: etcd has compacted its history past that revision."""


Permission = Literal["read", "write", "readwrite"]


@dataclass(frozen=True)
class RolePermission:
    """What a role may do (``perm``) on ``key`` alone, or with ``prefix`` on every key under it."""

    key: str
    perm: Permission
    prefix: bool = False


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end`` of a prefix)."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


class EtcdClient(abc.ABC):
    """A thread-safe client of one etcd v3 cluster.

    Every operation may raise :class:`EtcdConnectionError` (the cluster did not answer within
    ``config.op_timeout``) or :class:`EtcdError` (the cluster refused the request). ``close()`` releases
    connections; a closed client connects again on its next request.
    """

    # -- identity ------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def config(self) -> EtcdConfig:
        """The settings this client was made from (timeouts included)."""

    @property
    @abc.abstractmethod
    def endpoints_label(self) -> str:
        """The endpoints in one line, for error messages."""

    @abc.abstractmethod
    def ping(self, timeout: timedelta | None = None) -> int:
        """Return the cluster's current revision; raise :class:`EtcdConnectionError` if no endpoint answers
        within ``timeout`` (default ``config.op_timeout``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (idempotent). It is final: afterwards every request and
        :meth:`wait_for_event` raise :class:`EtcdClientClosedError`, :meth:`watch_revisions` returns, and
        nothing reconnects (a thread its owner did not stop cannot open a connection that nobody closes)."""

    # -- reads ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str) -> tuple[KeyValue | None, int]:
        """Return ``(key's value or None, revision of the read)``."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Return every key under ``prefix`` in key order, and the revision of the read."""

    @abc.abstractmethod
    def count_prefix(self, prefix: str) -> int:
        """How many keys are under ``prefix``."""

    @abc.abstractmethod
    def get_with_prefix(self, key: str, prefix: str) -> tuple[KeyValue | None, list[KeyValue], int]:
        """Read ``key`` and every key under ``prefix`` at one revision; return both and that revision."""

    @abc.abstractmethod
    def read_prefixes(self, prefixes: Sequence[str]) -> tuple[list[list[KeyValue]], int]:
        """Read every key under each of ``prefixes`` at one revision: one list per prefix, in order."""

    # -- writes --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write unconditionally (attached to ``lease`` unless 0); return the new revision.

        Raises :class:`EtcdError` if ``lease`` is not a live lease."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    @abc.abstractmethod
    def compare_and_put(
        self,
        key: str,
        value: bytes,
        *,
        mod_revision: int,
        lease: int = 0,
        read_prefix: str | None = None,
        guard: tuple[str, int] | None = None,
    ) -> tuple[bool, KeyValue | None, list[KeyValue], int]:
        """Put ``value`` only if ``key``'s mod revision equals ``mod_revision`` (0: key must not exist).

        ``guard``, when given as ``(key, create_revision)``, must also hold (a fencing token: the key must
        still exist with that create revision; ``0`` means it must not exist). In the same transaction,
        reads ``key`` (after the put, or the current value on failure) and, if ``read_prefix`` is given,
        every key under it. Returns ``(succeeded, key's value, prefix values, revision)``. Raises
        :class:`EtcdError` if the put runs and ``lease`` is not a live lease.
        """

    @abc.abstractmethod
    def commit(
        self,
        puts: Sequence[tuple[str, bytes]] = (),
        deletes: Sequence[str] = (),
        *,
        delete_prefixes: Sequence[str] = (),
        expect: Sequence[tuple[str, int]] = (),
        guard: tuple[str, int] | None = None,
    ) -> tuple[bool, int]:
        """Apply ``puts``, ``deletes`` and ``delete_prefixes`` in one transaction, all or nothing.

        The transaction applies only if every ``(key, mod_revision)`` in ``expect`` holds (0: the key must
        not exist) and, when ``guard=(key, create_revision)`` is given, that fencing key still exists with
        that create revision. Returns ``(applied, revision)``; the revision rises by one only if the
        transaction changed something. Puts carry no lease.
        """

    @abc.abstractmethod
    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()) -> TxnResult:
        """Run one etcd transaction: ``success`` if every compare in ``compare`` holds, else ``failure``.

        The ops of the branch that runs apply atomically, in order (see :mod:`elastic.etcd.txn` for the
        compares, range compares included). Returns whether the compares held, the revision after the
        transaction (one more than before only if the branch wrote something) and one result per op of
        that branch. Raises :class:`EtcdError` if a put of the branch names a lease that is not live, or
        when etcd refuses the request (more than 128 compares or ops in a branch, one key put twice or
        put and deleted, an empty key); then nothing is applied.
        """

    # -- leases --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def grant_lease(self, ttl: timedelta) -> int:
        """Grant a lease of ``ttl`` (whole seconds, at least 1; the cluster may raise it to its minimum);
        return its id (never 0)."""

    @abc.abstractmethod
    def keep_alive_once(self, lease_id: int) -> int:
        """Refresh a lease once; return its remaining TTL in seconds (<= 0: the lease is gone)."""

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; revoking a lease that is gone does nothing."""

    # -- watches -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def wait_for_event(self, key: str, start_revision: int, timeout: timedelta, *, prefix: bool = False) -> bool:
        """Block until ``key`` (or a key under it, if ``prefix``) changes at or after ``start_revision``.

        A change already made at or after ``start_revision`` counts at once; ``start_revision`` 0 means
        "after now". Returns True on a change, False when ``timeout`` passes first; an unreachable
        cluster is waited out (a timeout, not an error).
        """

    @abc.abstractmethod
    def watch_revisions(
        self,
        key: str,
        start_revision: int,
        on_revision: Callable[[int], None],
        stop: threading.Event,
        *,
        prefix: bool = False,
    ) -> None:
        """Stream changes of ``key`` (or keys under it) from ``start_revision`` until ``stop`` is set,
        calling ``on_revision(revision)`` with the newest revision of each batch of changes, in increasing
        order. Nothing is missed across broken connections. Runs in the caller's thread; returns once ``stop``
        is set or the client is closed."""


class TxnEtcdClient(EtcdClient):
    """An :class:`EtcdClient` whose convenience transactions (``get_with_prefix``, ``read_prefixes``,
    ``compare_and_put``, ``commit``) are each one :meth:`~EtcdClient.txn`: written here once, for both
    implementations (which provide ``txn`` and the single requests). Wrappers that forward every abstract
    method of :class:`EtcdClient` (``elastic.testing.counting_etcd``) still see each by its name.
    """

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """:meth:`EtcdClient.get_prefix`: read in pages (:meth:`read_prefixes`)."""
        (kvs,), revision = self.read_prefixes([prefix])
        return kvs, revision

    def get_with_prefix(self, key: str, prefix: str) -> tuple[KeyValue | None, list[KeyValue], int]:
        """:meth:`EtcdClient.get_with_prefix`: the key and the prefix's first page in one transaction, the rest of
        the prefix in pages at that transaction's revision."""
        head, (under,), revision = self._read_paged([GetOp(key)], [prefix])
        return (head[0].kvs[0] if head[0].kvs else None), under, revision

    def read_prefixes(self, prefixes: Sequence[str]) -> tuple[list[list[KeyValue]], int]:
        """:meth:`EtcdClient.read_prefixes`: one transaction reads the first page of every prefix, further pages
        are read at its revision (so the whole read is still one revision's), each prefix continuing after its
        last key. No number or size of keys breaks it: a page the client cannot receive whole
        (:class:`EtcdResponseTooLargeError`) is asked again at half the size; a history compacted under the read
        (:class:`EtcdCompactedError`) starts it again."""
        _, lists, revision = self._read_paged([], prefixes)
        return lists, revision

    def _read_paged(
        self, head: Sequence[GetOp], prefixes: Sequence[str]
    ) -> tuple[list[GetResult], list[list[KeyValue]], int]:
        for attempt in range(_PAGED_READ_TRIES):
            try:
                return self._read_paged_once(head, prefixes)
            except EtcdCompactedError:
                if attempt == _PAGED_READ_TRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_paged_once(
        self, head: Sequence[GetOp], prefixes: Sequence[str]
    ) -> tuple[list[GetResult], list[list[KeyValue]], int]:
        limit = READ_PAGE_KEYS
        while True:
            try:
                first = self.txn([], [*head, *(GetOp(p, prefix=True, limit=limit) for p in prefixes)])
                break
            except EtcdResponseTooLargeError:
                if limit == 1:
                    raise
                limit = max(1, limit // 2)
        revision = first.revision
        lists: list[list[KeyValue]] = []
        for i, prefix in enumerate(prefixes):
            page = first.get(len(head) + i)
            kvs = list(page.kvs)
            left = page.count - len(page.kvs)
            while left > 0 and kvs:
                try:
                    page = self.txn(
                        [], [GetOp(prefix, prefix=True, after=kvs[-1].key, revision=revision, limit=limit)]
                    ).get(0)
                except EtcdResponseTooLargeError:
                    if limit == 1:
                        raise
                    limit = max(1, limit // 2)
                    continue
                if not page.kvs:
                    break
                kvs += page.kvs
                left = page.count - len(page.kvs)
            lists.append(kvs)
        return [first.get(i) for i in range(len(head))], lists, revision

    def compare_and_put(
        self,
        key: str,
        value: bytes,
        *,
        mod_revision: int,
        lease: int = 0,
        read_prefix: str | None = None,
        guard: tuple[str, int] | None = None,
    ) -> tuple[bool, KeyValue | None, list[KeyValue], int]:
        """:meth:`EtcdClient.compare_and_put`: one transaction (the put, then the reads; the reads alone if a
        compare fails)."""
        compares = [Compare(key, CompareTarget.MOD, CompareOp.EQUAL, mod_revision), *_fence(guard)]
        reads = [GetOp(key)]
        if read_prefix is not None:
            reads.append(GetOp(read_prefix, prefix=True))
        result = self.txn(compares, [PutOp(key, value, lease), *reads], reads)
        ranges = [r.kvs for r in result.results if isinstance(r, GetResult)]
        cur = ranges[0][0] if ranges and ranges[0] else None
        return result.succeeded, cur, (list(ranges[1]) if len(ranges) > 1 else []), result.revision

    def commit(
        self,
        puts: Sequence[tuple[str, bytes]] = (),
        deletes: Sequence[str] = (),
        *,
        delete_prefixes: Sequence[str] = (),
        expect: Sequence[tuple[str, int]] = (),
        guard: tuple[str, int] | None = None,
    ) -> tuple[bool, int]:
        """:meth:`EtcdClient.commit`: one transaction of the puts, then the deletes, then the prefix deletes."""
        compares = [Compare(k, CompareTarget.MOD, CompareOp.EQUAL, r) for k, r in expect]
        ops: list[TxnOp] = [PutOp(k, v) for k, v in puts]
        ops += [DeleteOp(k) for k in deletes]
        ops += [DeleteOp(p, prefix=True) for p in delete_prefixes]
        result = self.txn([*compares, *_fence(guard)], ops)
        return result.succeeded, result.revision


#: keys a prefix read asks for per page (then per etcd request): at a few KB per record a page stays well below
#: gRPC's 4 MiB answer, and a page that does not is asked again at half the size
READ_PAGE_KEYS = 512
_PAGED_READ_TRIES = 3  # a paged read whose revision etcd compacted meanwhile starts again this many times


class EtcdAuth(abc.ABC):
    """A thread-safe client of one etcd v3 cluster's users and roles (etcd's role-based access control).

    Users and roles live beside the keys, not in them: managing them changes no revision. etcd allows it to
    anyone while auth is disabled, and to users with the ``root`` role once it is enabled; a user's
    permissions are the union of its roles' :class:`RolePermission`. Every operation may raise
    :class:`EtcdConnectionError` or :class:`EtcdError`, as :class:`EtcdClient`'s do; a call retried after a
    lost answer meets its own effect (``False``: the user exists already, or is gone), so all are safe to retry.
    Both clients of this package implement it beside :class:`EtcdClient` (:func:`auth_of`).
    """

    @abc.abstractmethod
    def user_add(self, name: str, password: str) -> bool:
        """Create a user with ``password``; False (and nothing changed) if the user exists already."""

    @abc.abstractmethod
    def user_change_password(self, name: str, password: str) -> None:
        """Set an existing user's password; raises :class:`EtcdError` if there is no such user."""

    @abc.abstractmethod
    def user_delete(self, name: str) -> bool:
        """Delete a user (its tokens stop working at once); False if there was no such user."""

    @abc.abstractmethod
    def user_list(self) -> list[str]:
        """Every user's name, sorted."""

    @abc.abstractmethod
    def user_grant_role(self, user: str, role: str) -> None:
        """Give ``user`` the role ``role`` (again: nothing changes); raises :class:`EtcdError` if either
        is missing."""

    @abc.abstractmethod
    def role_add(self, name: str) -> bool:
        """Create a role without permissions; False (and nothing changed) if the role exists already."""

    @abc.abstractmethod
    def role_delete(self, name: str) -> bool:
        """Delete a role (its users lose its permissions); False if there was no such role."""

    @abc.abstractmethod
    def role_grant_permission(self, role: str, permission: RolePermission) -> None:
        """Let ``role`` do ``permission`` (granting one range again replaces its ``perm``); raises
        :class:`EtcdError` if there is no such role."""

    @abc.abstractmethod
    def role_revoke_permission(self, role: str, key: str, prefix: bool = False) -> bool:
        """Take back ``role``'s permission on ``key`` (with ``prefix``: on every key under it); False if it had
        none there; raises :class:`EtcdError` if there is no such role."""

    @abc.abstractmethod
    def role_permissions(self, role: str) -> list[RolePermission]:
        """The permissions of ``role``, by key (ranges other than one key or a prefix are left out);
        raises :class:`EtcdError` if there is no such role."""


def auth_of(client: EtcdClient) -> EtcdAuth:
    """``client``'s users and roles: the same object, as an :class:`EtcdAuth` (both clients of this package are
    one); raises :class:`TypeError` for a client that manages none."""
    if not isinstance(client, EtcdAuth):
        raise TypeError(f"{type(client).__name__} manages no etcd users or roles (it is no EtcdAuth)")
    return client


def _fence(guard: tuple[str, int] | None) -> list[Compare]:
    """The compare of a fencing ``guard=(key, create_revision)``: the key still exists with that create
    revision (0: it must not exist); none without one."""
    return [] if guard is None else [Compare(guard[0], CompareTarget.CREATE, CompareOp.EQUAL, guard[1])]
