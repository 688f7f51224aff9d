"""A lease kept alive by a daemon thread, re-granted (and its keys re-written) if it is ever lost."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from elastic.etcd.api import EtcdClient, EtcdError

logger = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Holds one etcd lease for the life of a process.

    The lease is refreshed every ``ttl / 3``. If etcd says the lease is gone (it expired during a
    partition or an etcd outage longer than the TTL) a new one is granted and ``on_new_lease`` is
    called with its id, so the owner can attach its keys again. ``close()`` revokes the lease, which
    deletes every key attached to it at once: this is how a clean exit is told apart from a death.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: timedelta,
        on_new_lease: Callable[[int], None] | None = None,
        name: str = "lease",
    ) -> None:
        if ttl < timedelta(seconds=1):
            raise ValueError("lease TTL must be at least 1 second")
        self._client = client
        self._ttl = ttl
        self._on_new_lease = on_new_lease
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._lease_id = client.grant_lease(ttl)
        if on_new_lease is not None:
            on_new_lease(self._lease_id)
        self._thread = threading.Thread(target=self._run, name=f"etcd-{name}-keepalive", daemon=True)
        self._thread.start()

    @property
    def lease_id(self) -> int:
        with self._lock:
            return self._lease_id

    def _run(self) -> None:
        interval = max(self._ttl.total_seconds() / 3.0, 0.2)
        while not self._stop.wait(interval):
            try:
                remaining = self._client.keep_alive_once(self.lease_id)
                if remaining <= 0:
                    self._regrant()
            except EtcdError as exc:
                logger.warning("etcd lease keep-alive failed (%s); retrying", exc)
            except Exception:  # the thread must survive anything
                logger.exception("unexpected error in the etcd lease keep-alive")

    def _regrant(self) -> None:
        new_id = self._client.grant_lease(self._ttl)
        with self._lock:
            self._lease_id = new_id
        logger.warning("etcd lease was lost; granted a new one (%x)", new_id)
        if self._on_new_lease is not None:
            self._on_new_lease(new_id)

    def replace_lost(self, lost_id: int) -> int:
        """etcd said ``lost_id`` is gone (a request attaching a key to it failed): grant a new lease now,
        unless the keep-alive thread already has, and return the current id."""
        with self._lock:
            current = self._lease_id
        if current == lost_id and not self._stop.is_set():
            self._regrant()
        return self.lease_id

    def close(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` (default) delete the lease and its keys now."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke:
            try:
                self._client.revoke_lease(self.lease_id)
            except EtcdError:
                logger.debug("could not revoke lease %x", self.lease_id, exc_info=True)
