"""An in-memory model of an etcd v3 cluster, for unit tests that need no etcd binary: its clients.

:class:`MemoryEtcdServer` (a :class:`~elastic.etcd.memory_server.MemoryCluster`) holds one cluster's state:
the global revision, every key's create and mod revisions and version, leases that expire by a clock, and the
history of changes that watches replay. :class:`MemoryEtcdClient` is an
:class:`~elastic.etcd.api.EtcdClient` of one such server; several clients of one server model several
processes on one cluster. Every key/value request is one etcd transaction of :mod:`elastic.etcd.txn` parts,
run by :meth:`MemoryEtcdServer.txn` with etcd's rules, so the client keeps the gRPC client's contract
(``tests/elastic/etcd/test_client_contract.py`` runs one suite against both).

A client cut off from the cluster (:meth:`MemoryEtcdClient.set_reachable`) fails at once with
:class:`~elastic.etcd.api.EtcdConnectionError` and its waits see nothing, while leases keep expiring.
Users and roles are kept (:class:`MemoryAuth`) but not enforced: every client may do anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from elastic.etcd.api import (
    EtcdAuth,
    EtcdClientClosedError,
    EtcdConnectionError,
    KeyValue,
    RolePermission,
    TxnEtcdClient,
    prefix_end,
)
from elastic.etcd.config import EtcdConfig
from elastic.etcd.memory_server import TICK, ManualClock, MemoryAuth, MemoryCluster, check_key
from elastic.etcd.txn import Compare, DeleteOp, GetOp, PutOp, TxnOp, TxnResult

__all__ = ["TICK", "ManualClock", "MemoryAuth", "MemoryEtcdClient", "MemoryEtcdServer"]


class MemoryEtcdServer(MemoryCluster):
    """One modelled cluster (:class:`~elastic.etcd.memory_server.MemoryCluster`) that hands out clients."""

    def client(self, config: EtcdConfig | None = None) -> MemoryEtcdClient:
        """A new client of this cluster (one per modelled process)."""
        return MemoryEtcdClient(self, config)


class MemoryEtcdClient(TxnEtcdClient, EtcdAuth):
    """An :class:`EtcdClient` of a :class:`MemoryEtcdServer` (a new private one unless given).

    Unlike the gRPC client, a client cut off by :meth:`set_reachable` fails at once instead of retrying
    until ``config.op_timeout``; its waits still run to their timeout, as the real ones do.
    """

    def __init__(self, server: MemoryEtcdServer | None = None, config: EtcdConfig | None = None) -> None:
        self.server = server if server is not None else MemoryEtcdServer()
        self._config = config if config is not None else EtcdConfig(endpoints=((self.server.name, 0),))
        self._reachable = threading.Event()
        self._reachable.set()
        self._closed = False  # close() is final, as the gRPC client's (EtcdClient.close)

    @property
    def config(self) -> EtcdConfig:
        return self._config

    @property
    def endpoints_label(self) -> str:
        return f"memory://{self.server.name}"

    def set_reachable(self, reachable: bool) -> None:
        """Cut this client off from the cluster (a partition) or reconnect it."""
        if reachable:
            self._reachable.set()
        else:
            self._reachable.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise EtcdClientClosedError(f"the etcd client of {self.endpoints_label} is closed")

    def _check(self) -> None:
        self._check_open()
        if not self._reachable.is_set():
            raise EtcdConnectionError(f"etcd unreachable at {self.endpoints_label} (client cut off)")

    def _txn(self, cmps: Sequence[Compare], ops: Sequence[TxnOp], failure: Sequence[TxnOp] = ()) -> TxnResult:
        self._check()
        return self.server.txn(cmps, ops, failure)

    def ping(self, timeout: timedelta | None = None) -> int:
        self._check()
        return self.server.revision

    def close(self) -> None:  # the server outlives its clients; the client is done with
        self._closed = True

    # -- reads ---------------------------------------------------------------------------------------
    def _read(self, gets: Sequence[GetOp]) -> tuple[list[list[KeyValue]], int]:
        result = self._txn([], gets)
        return [list(result.get(i).kvs) for i in range(len(gets))], result.revision

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        (kvs,), revision = self._read([GetOp(key)])
        return (kvs[0] if kvs else None), revision

    def count_prefix(self, prefix: str) -> int:
        return self._txn([], [GetOp(prefix, prefix=True, count_only=True)]).get(0).count

    # -- writes --------------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        return self._txn([], [PutOp(key, value, lease)]).revision

    def delete(self, key: str) -> bool:
        deleted = self._txn([], [DeleteOp(key)]).results[0]
        return isinstance(deleted, int) and deleted > 0

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()) -> TxnResult:
        return self._txn(compare, success, failure)

    # -- leases --------------------------------------------------------------------------------------
    def grant_lease(self, ttl: timedelta) -> int:
        self._check()
        return self.server.grant_lease(max(1, round(ttl.total_seconds())))

    def keep_alive_once(self, lease_id: int) -> int:
        self._check()
        return self.server.keep_alive(lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        self._check()
        self.server.revoke_lease(lease_id)

    # -- watches -------------------------------------------------------------------------------------
    def _watch_range(self, key: str, prefix: bool) -> tuple[bytes, bytes | None]:
        raw = key.encode()
        check_key(raw)
        return raw, (prefix_end(key) if prefix else None)

    def wait_for_event(self, key: str, start_revision: int, timeout: timedelta, *, prefix: bool = False) -> bool:
        raw, end = self._watch_range(key, prefix)
        deadline = time.monotonic() + timeout.total_seconds()
        start: int | None = None
        while True:
            self._check_open()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self._reachable.is_set():
                self._reachable.wait(min(remaining, TICK))
                continue
            if start is None:
                start = self.server.start_revision(start_revision)
            if self.server.wait_change(raw, end, start, min(remaining, TICK)):
                return True

    def watch_revisions(
        self,
        key: str,
        start_revision: int,
        on_revision: Callable[[int], None],
        stop: threading.Event,
        *,
        prefix: bool = False,
    ) -> None:
        raw, end = self._watch_range(key, prefix)
        next_revision: int | None = None
        while not stop.is_set() and not self._closed:
            if not self._reachable.is_set():
                stop.wait(TICK)
                continue
            if next_revision is None:
                next_revision = self.server.start_revision(start_revision)
            newest = self.server.wait_change(raw, end, next_revision, TICK)
            if newest and not stop.is_set():
                next_revision = newest + 1
                on_revision(newest)

    # -- users and roles -------------------------------------------------------------------------------
    def user_add(self, name: str, password: str) -> bool:
        self._check()
        return self.server.auth.user_add(name, password)

    def user_change_password(self, name: str, password: str) -> None:
        self._check()
        self.server.auth.user_change_password(name, password)

    def user_delete(self, name: str) -> bool:
        self._check()
        return self.server.auth.user_delete(name)

    def user_list(self) -> list[str]:
        self._check()
        return self.server.auth.user_list()

    def user_grant_role(self, user: str, role: str) -> None:
        self._check()
        self.server.auth.user_grant_role(user, role)

    def role_add(self, name: str) -> bool:
        self._check()
        return self.server.auth.role_add(name)

    def role_delete(self, name: str) -> bool:
        self._check()
        return self.server.auth.role_delete(name)

    def role_grant_permission(self, role: str, permission: RolePermission) -> None:
        self._check()
        self.server.auth.role_grant_permission(role, permission)

    def role_revoke_permission(self, role: str, key: str, prefix: bool = False) -> bool:
        self._check()
        return self.server.auth.role_revoke_permission(role, key, prefix)

    def role_permissions(self, role: str) -> list[RolePermission]:
        self._check()
        return self.server.auth.role_permissions(role)
