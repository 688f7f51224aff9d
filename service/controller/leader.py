"""Leader election among controller replicas by an etcd lease, with fencing (not an etcd lock).

A replica becomes leader by creating the leader key, attached to its own lease, in a transaction that
requires the key not to exist. The key's *create revision* is then the replica's fencing token: every
write the leader makes is a transaction guarded by ``(leader key, create revision)``, so a replica that
lost its lease (a pause, a partition) and was replaced cannot write anything any more, even if it still
believes it leads. Losing the lease deletes the key; the next campaign of any replica takes over.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

from elastic.etcd import EtcdClient
from elastic.etcd.lease import LeaseKeeper

logger = logging.getLogger(__name__)

__all__ = ["LeaderElection", "create_election"]


class LeaderElection:
    """One replica's candidacy. ``campaign()`` is cheap and idempotent; call it before each reconcile.

    ``fence`` is the ``(key, create_revision)`` guard to pass to fenced writes while leader, else None.
    """

    def __init__(self, client: EtcdClient, key: str, replica_id: str, ttl: timedelta) -> None:
        self._client = client
        self._key = key
        self._replica_id = replica_id
        self._ttl = ttl
        self._lock = threading.Lock()
        self._keeper: LeaseKeeper | None = None
        self._keeper_lease = 0
        self._fence: tuple[str, int] | None = None

    @property
    def key(self) -> str:
        return self._key

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def fence(self) -> tuple[str, int] | None:
        with self._lock:
            return self._fence

    @property
    def is_leader(self) -> bool:
        return self.fence is not None

    def campaign(self) -> bool:
        """Become (or confirm being) the leader; returns whether this replica leads now."""
        with self._lock:
            if self._keeper is None:
                self._keeper = LeaseKeeper(self._client, self._ttl, name="leader")
                self._keeper_lease = self._keeper.lease_id
            keeper = self._keeper
            if keeper.lease_id != self._keeper_lease:  # the keeper had to re-grant: the old key is gone
                self._keeper_lease = keeper.lease_id
                if self._fence is not None:
                    logger.warning("controller %s lost its leader lease; no longer leader", self._replica_id)
                self._fence = None
            fence = self._fence
        if fence is not None:
            kv, _ = self._client.get(self._key)
            if kv is not None and kv.create_revision == fence[1]:
                return True
            with self._lock:
                self._fence = None
            logger.warning("controller %s was deposed as leader", self._replica_id)
        value = json.dumps({"replica": self._replica_id, "since": time.time()}).encode()
        ok, kv, _, _ = self._client.compare_and_put(self._key, value, mod_revision=0, lease=keeper.lease_id)
        if ok and kv is not None:
            with self._lock:
                self._fence = (self._key, kv.create_revision)
            logger.info("controller %s is now the leader (fencing revision %d)", self._replica_id, kv.create_revision)
            return True
        return False

    def leader(self) -> dict[str, Any] | None:
        """The current leader's identity (``{"replica": ..., "since": ...}``), or None."""
        kv, _ = self._client.get(self._key)
        if kv is None:
            return None
        try:
            data = json.loads(kv.value)
            return data if isinstance(data, dict) else None
        except ValueError:
            return {"replica": kv.value.decode(errors="replace")}

    def wait_for_change(self, timeout: timedelta) -> None:
        """Block until the leader key changes (e.g. the leader's lease expired) or ``timeout`` passes."""
        kv, revision = self._client.get(self._key)
        if kv is None:
            return
        self._client.wait_for_event(self._key, revision + 1, timeout)

    def resign(self) -> None:
        """Give up leadership now (revoking the lease deletes the key) and stop refreshing the lease."""
        with self._lock:
            keeper, self._keeper, self._fence = self._keeper, None, None
        if keeper is not None:
            keeper.close(revoke=True)


def create_election(client: EtcdClient, key: str, replica_id: str, ttl: timedelta) -> LeaderElection:
    return LeaderElection(client, key, replica_id, ttl)
