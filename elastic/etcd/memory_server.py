"""The in-memory etcd v3 cluster's server side; its clients are in :mod:`elastic.etcd.memory`.

:class:`MemoryCluster` holds one cluster's state: the global revision, every key's create and mod revisions
and version, leases that expire by a clock, and the history of changes that watches replay. Every key/value
request is one etcd transaction of :mod:`elastic.etcd.txn` parts (compares, range compares included, then
puts, deletes and gets), run by :meth:`MemoryCluster.txn` with etcd's rules.

Leases expire when the cluster's ``clock`` (``time.monotonic``, or a :class:`ManualClock` a test advances)
passes their deadline, noticed by every request and by every waiter within :data:`TICK` seconds; wait
timeouts are real time. Users and roles are kept (:class:`MemoryAuth`) but not enforced.
Not modelled: compaction (the whole history is kept), permission checks, cluster membership.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from elastic.etcd.api import (
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdResponseTooLargeError,
    KeyValue,
    RolePermission,
    prefix_end,
)
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

logger = logging.getLogger(__name__)

__all__ = ["TICK", "ManualClock", "MemoryAuth", "MemoryCluster"]

TICK = 0.05
"""Seconds a waiter sleeps at most before it looks at the clock (lease expiry) and its stop event again."""


class ManualClock:
    """A clock that moves only when told to (``advance``); pass it to :class:`~elastic.etcd.memory.MemoryEtcdServer`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += seconds


@dataclass
class _Entry:
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass
class _Lease:
    ttl: int
    expires_at: float
    keys: set[bytes] = field(default_factory=set)


# A range as etcd has it: ``end`` None means just ``key``, b"\0" every key from ``key`` on.
def _span(key: str, prefix: bool) -> tuple[bytes, bytes | None]:
    return key.encode(), (prefix_end(key) if prefix else None)


def _as_of(versions: list[tuple[int, _Entry | None]], revision: int) -> _Entry | None:
    """A key's entry as it was at ``revision`` (None: not there then), from its ``(revision, entry)`` versions."""
    i = bisect.bisect_right(versions, revision, key=lambda version: version[0])
    return versions[i - 1][1] if i else None


def _in_range(k: bytes, key: bytes, end: bytes | None) -> bool:
    return k == key if end is None else key <= k and (end == b"\0" or k < end)


def _satisfies(cmp: Compare, entry: _Entry) -> bool:
    """Whether one key (a missing one as an all-zero ``entry``) satisfies ``cmp`` (etcd's compareKV)."""
    if isinstance(cmp.value, bytes):  # a VALUE compare (Compare checks that the types match)
        sign = (entry.value > cmp.value) - (entry.value < cmp.value)
    else:
        revisions = {
            CompareTarget.CREATE: entry.create_revision,
            CompareTarget.MOD: entry.mod_revision,
            CompareTarget.VERSION: entry.version,
        }
        actual = revisions[cmp.target]
        sign = (actual > cmp.value) - (actual < cmp.value)
    if cmp.op == CompareOp.EQUAL:
        return sign == 0
    if cmp.op == CompareOp.NOT_EQUAL:
        return sign != 0
    return sign < 0 if cmp.op == CompareOp.LESS else sign > 0


def check_key(key: bytes) -> None:
    if not key:
        raise EtcdError("etcdserver: key is not provided")


def _check_ops(ops: Sequence[TxnOp], max_ops: int) -> int:
    """Refuse what etcd refuses in one branch of a transaction; return the bytes it carries."""
    if len(ops) > max_ops:
        raise EtcdError("etcdserver: too many operations in txn request")
    puts = [op.key.encode() for op in ops if isinstance(op, PutOp)]
    if len(set(puts)) < len(puts):
        raise EtcdError("etcdserver: duplicate key given in txn request")
    size = 0
    for op in ops:
        key, end = _span(op.key, not isinstance(op, PutOp) and op.prefix)
        check_key(key)
        if isinstance(op, DeleteOp) and any(_in_range(k, key, end) for k in puts):
            raise EtcdError("etcdserver: duplicate key given in txn request")
        size += len(key) + (len(op.value) if isinstance(op, PutOp) else len(end or b""))
    return size


class MemoryAuth:
    """A modelled cluster's users and roles (etcd's answers, never its checks); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, tuple[str, set[str]]] = {}  # name -> (password, roles)
        self._roles: dict[str, dict[tuple[str, bool], RolePermission]] = {}  # name -> (key, prefix) -> grant

    def password(self, user: str) -> str | None:
        """The user's password (a test's view), None if there is no such user."""
        with self._lock:
            entry = self._users.get(user)
            return entry[0] if entry else None

    def roles_of(self, user: str) -> set[str]:
        with self._lock:
            entry = self._users.get(user)
            return set(entry[1]) if entry else set()

    def user_add(self, name: str, password: str) -> bool:
        if not name:
            raise EtcdError("etcdserver: user name is empty")
        with self._lock:
            if name in self._users:
                return False
            self._users[name] = (password, set())
            return True

    def user_change_password(self, name: str, password: str) -> None:
        with self._lock:
            if name not in self._users:
                raise EtcdError("etcdserver: user name not found")
            self._users[name] = (password, self._users[name][1])

    def user_delete(self, name: str) -> bool:
        with self._lock:
            return self._users.pop(name, None) is not None

    def user_list(self) -> list[str]:
        with self._lock:
            return sorted(self._users)

    def user_grant_role(self, user: str, role: str) -> None:
        with self._lock:
            if user not in self._users:
                raise EtcdError("etcdserver: user name not found")
            if role not in self._roles:
                raise EtcdError("etcdserver: role name not found")
            self._users[user][1].add(role)

    def role_add(self, name: str) -> bool:
        if not name:
            raise EtcdError("etcdserver: role name is empty")
        with self._lock:
            if name in self._roles:
                return False
            self._roles[name] = {}
            return True

    def role_delete(self, name: str) -> bool:
        with self._lock:
            if self._roles.pop(name, None) is None:
                return False
            for _, roles in self._users.values():
                roles.discard(name)
            return True

    def role_grant_permission(self, role: str, permission: RolePermission) -> None:
        if not permission.key:
            raise EtcdError("an empty key cannot be granted")
        with self._lock:
            grants = self._roles.get(role)
            if grants is None:
                raise EtcdError("etcdserver: role name not found")
            grants[(permission.key, permission.prefix)] = permission

    def role_revoke_permission(self, role: str, key: str, prefix: bool = False) -> bool:
        with self._lock:
            grants = self._roles.get(role)
            if grants is None:
                raise EtcdError("etcdserver: role name not found")
            return grants.pop((key, prefix), None) is not None

    def role_permissions(self, role: str) -> list[RolePermission]:
        with self._lock:
            grants = self._roles.get(role)
            if grants is None:
                raise EtcdError("etcdserver: role name not found")
            return [grants[k] for k in sorted(grants)]


class MemoryCluster:
    """One modelled cluster, shared by any number of clients (thread-safe); tests use its subclass
    :class:`~elastic.etcd.memory.MemoryEtcdServer`, which hands out clients.

    It refuses what a real cluster refuses: more than ``max_txn_ops`` operations in a branch of a
    transaction (etcd's ``--max-txn-ops``), a request over ``max_request_bytes`` of keys and values
    (``--max-request-bytes``), one key put twice or put and deleted in one transaction, an empty key.
    Leases get at least ``min_lease_ttl`` seconds (a real cluster's minimum depends on its election timeout).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        name: str = "memory",
        min_lease_ttl: int = 1,
        max_txn_ops: int = 128,
        max_request_bytes: int = 1536 * 1024,
        max_response_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.name = name
        self._clock = clock
        self._min_lease_ttl = max(1, min_lease_ttl)
        self._max_txn_ops = max_txn_ops
        self._max_request_bytes = max_request_bytes
        self._max_response_bytes = max_response_bytes
        self._cond = threading.Condition()
        self._revision = 1  # a new etcd cluster answers at revision 1
        self._data: dict[bytes, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x6D656D0000000001)
        self._history: list[tuple[int, bytes]] = []  # (revision, key) of every change, in order
        # every key's values since it was first written, as (revision, entry or None once deleted), for reads at a
        # past revision (``GetOp.revision``)
        self._versions: dict[bytes, list[tuple[int, _Entry | None]]] = {}
        self.auth = MemoryAuth()

    @property
    def revision(self) -> int:
        with self._cond:
            self._expire_locked()
            return self._revision

    def lease_ids(self) -> list[int]:
        with self._cond:
            self._expire_locked()
            return sorted(self._leases)

    def expire_leases(self) -> None:
        """Revoke every lease whose TTL has passed on the clock (every request does this first)."""
        with self._cond:
            self._expire_locked()

    # -- key/value -----------------------------------------------------------------------------------
    def txn(self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()) -> TxnResult:
        """Run one transaction: ``success`` if every compare holds, else ``failure``, atomically.

        The revision rises by one if the ops changed something. A put naming a lease that is not live
        fails the whole transaction with :class:`EtcdError`, before anything is written, as does a request
        etcd refuses outright."""
        if len(compares) > self._max_txn_ops:
            raise EtcdError("etcdserver: too many operations in txn request")
        for cmp in compares:
            check_key(cmp.key.encode())
        size = _check_ops(success, self._max_txn_ops) + _check_ops(failure, self._max_txn_ops)
        if size + sum(len(c.key.encode()) for c in compares) > self._max_request_bytes:
            raise EtcdError("etcdserver: request is too large")
        with self._cond:
            self._expire_locked()
            ok = all(self._holds(c) for c in compares)
            ops = success if ok else failure
            for op in ops:
                if isinstance(op, PutOp) and op.lease and op.lease not in self._leases:
                    raise EtcdLeaseNotFoundError("etcdserver: requested lease not found")
            revision = self._revision + 1
            changed = False
            results: list[GetResult | int | None] = []
            for op in ops:
                if isinstance(op, PutOp):
                    self._put_locked(op, revision)
                    changed = True
                    results.append(None)
                elif isinstance(op, DeleteOp):
                    deleted = self._delete_locked(*_span(op.key, op.prefix), revision)
                    changed = changed or deleted > 0
                    results.append(deleted)
                else:
                    results.append(self._get_locked(op))
            if changed:
                self._revision = revision
                self._cond.notify_all()
            answer = sum(len(kv.key) + len(kv.value) + 32 for r in results if isinstance(r, GetResult) for kv in r.kvs)
            if answer > self._max_response_bytes:  # what a gRPC client may receive (its default: 4 MiB)
                raise EtcdResponseTooLargeError(
                    f"Received message larger than max ({answer} vs. {self._max_response_bytes})"
                )
            return TxnResult(ok, self._revision, tuple(results))

    def _holds(self, cmp: Compare) -> bool:
        """etcd's applyCompare: every key in the range satisfies ``cmp``; an empty range is compared as one
        all-zero key, except that a VALUE compare on it fails."""
        key, end = _span(cmp.key, cmp.prefix)
        if end is None:
            entries = [self._data[key]] if key in self._data else []
        else:
            entries = [e for k, e in self._data.items() if _in_range(k, key, end)]
        if not entries:
            if cmp.target == CompareTarget.VALUE:
                return False
            entries = [_Entry(value=b"", create_revision=0, mod_revision=0, version=0, lease=0)]
        return all(_satisfies(cmp, e) for e in entries)

    def _record(self, key: bytes, revision: int) -> None:
        """``key`` changed at ``revision`` (put, deleted, its lease revoked): called after the change."""
        self._history.append((revision, key))
        self._versions.setdefault(key, []).append((revision, self._data.get(key)))

    def _put_locked(self, op: PutOp, revision: int) -> None:
        key = op.key.encode()
        old = self._data.get(key)
        if old is not None and old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        self._data[key] = _Entry(
            value=op.value,
            create_revision=old.create_revision if old is not None else revision,
            mod_revision=revision,
            version=old.version + 1 if old is not None else 1,
            lease=op.lease,
        )
        if op.lease:
            self._leases[op.lease].keys.add(key)
        self._record(key, revision)

    def _delete_locked(self, key: bytes, end: bytes | None, revision: int) -> int:
        doomed = sorted(k for k in self._data if _in_range(k, key, end))
        for k in doomed:
            entry = self._data.pop(k)
            if entry.lease and entry.lease in self._leases:
                self._leases[entry.lease].keys.discard(k)
            self._record(k, revision)
        return len(doomed)

    def _range_locked(self, key: bytes, end: bytes | None, revision: int = 0) -> list[KeyValue]:
        if revision and revision < self._revision:
            entries = {
                k: e
                for k, versions in self._versions.items()
                if _in_range(k, key, end) and (e := _as_of(versions, revision)) is not None
            }
        else:
            entries = {k: e for k, e in self._data.items() if _in_range(k, key, end)}
        return [
            KeyValue(k.decode(), e.value, e.create_revision, e.mod_revision, lease=e.lease, version=e.version)
            for k, e in sorted(entries.items())
        ]

    def _get_locked(self, op: GetOp) -> GetResult:
        if op.revision > self._revision:
            raise EtcdError("etcdserver: mvcc: required revision is a future revision")
        key, end = _span(op.key, op.prefix)
        if op.after is not None:
            key = op.after.encode() + b"\0"
        kvs = self._range_locked(key, end, op.revision)
        count = len(kvs)
        if op.count_only:
            kvs = []
        elif op.limit > 0:
            kvs = kvs[: op.limit]
        if op.keys_only:
            kvs = [replace(kv, value=b"") for kv in kvs]
        return GetResult(tuple(kvs), count)

    # -- leases --------------------------------------------------------------------------------------
    def grant_lease(self, ttl: int) -> int:
        with self._cond:
            self._expire_locked()
            lease_id = next(self._lease_ids)
            seconds = max(ttl, self._min_lease_ttl)
            self._leases[lease_id] = _Lease(ttl=seconds, expires_at=self._clock() + seconds)
            return lease_id

    def keep_alive(self, lease_id: int) -> int:
        """Refresh a lease; its TTL, or 0 if it is gone."""
        with self._cond:
            self._expire_locked()
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            lease.expires_at = self._clock() + lease.ttl
            return lease.ttl

    def revoke_lease(self, lease_id: int) -> None:
        with self._cond:
            self._expire_locked()
            self._revoke_locked(lease_id)

    def _revoke_locked(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None or not lease.keys:
            return
        revision = self._revision + 1
        for k in sorted(lease.keys):
            del self._data[k]
            self._record(k, revision)
        self._revision = revision
        self._cond.notify_all()

    def _expire_locked(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            logger.debug("memory etcd %s: lease %x expired", self.name, lease_id)
            self._revoke_locked(lease_id)

    # -- watches -------------------------------------------------------------------------------------
    def start_revision(self, start_revision: int) -> int:
        """Where a watch from ``start_revision`` starts: 0 (or less) means the next revision."""
        return start_revision if start_revision > 0 else self.revision + 1

    def wait_change(self, key: bytes, end: bytes | None, start_revision: int, timeout: float) -> int:
        """The newest revision >= ``start_revision`` that changed a key in the range, waiting up to
        ``timeout`` seconds for one; 0 if none came."""
        check_key(key)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire_locked()
                first = bisect.bisect_left(self._history, start_revision, key=lambda change: change[0])
                for revision, changed in reversed(self._history[first:]):
                    if _in_range(changed, key, end):
                        return revision
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return 0
                self._cond.wait(min(remaining, TICK))
