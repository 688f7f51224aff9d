"""A lease kept alive by a daemon thread, re-granted (and its keys re-written) if it is ever lost.

Closing never holds a process for long while etcd is away: a lease whose client a keep-alive or a revoke found
unable to reach etcd, with no success since, is closed without waiting for its keep-alive thread or revoking it
(etcd drops it when its TTL runs out). So a process whose many handlers are released at exit (``atexit``) with
etcd gone spends about one request timeout finding that out (their keep-alives fail together), not one or two
per lease.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

from elastic.etcd.api import EtcdClient, EtcdConnectionError, EtcdError

logger = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]

#: how long a finding that etcd is unreachable counts when no request to it has succeeded since
_UNREACHABLE_FOR = 60.0
# client -> when a lease request of it last failed to reach etcd (per client: one may be cut off, another not)
_unreachable: weakref.WeakKeyDictionary[EtcdClient, float] = weakref.WeakKeyDictionary()
_unreachable_lock = threading.Lock()


def _reached(client: EtcdClient, ok: bool) -> None:
    with _unreachable_lock:
        if ok:
            _unreachable.pop(client, None)
        else:
            _unreachable[client] = time.monotonic()


def _known_unreachable(client: EtcdClient) -> bool:
    with _unreachable_lock:
        at = _unreachable.get(client)
    return at is not None and time.monotonic() - at < _UNREACHABLE_FOR


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
                _reached(self._client, True)
                if remaining <= 0:
                    self._regrant()
            except EtcdConnectionError as exc:
                _reached(self._client, False)
                logger.warning("etcd lease keep-alive failed (%s); retrying", exc)
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
        """Stop refreshing; with ``revoke`` (default) delete the lease and its keys now. With etcd known to be
        unreachable (see the module docstring) neither waits: the lease then ends with its TTL."""
        if self._stop.is_set():
            return
        self._stop.set()
        if _known_unreachable(self._client):
            logger.info(
                "etcd at %s is unreachable: lease %x is left to expire (TTL %gs)",
                self._client.endpoints_label,
                self.lease_id,
                self._ttl.total_seconds(),
            )
            return
        self._thread.join(timeout=5)
        if revoke and not _known_unreachable(self._client):  # (the keep-alive may just have found out)
            try:
                self._client.revoke_lease(self.lease_id)
                _reached(self._client, True)
            except EtcdConnectionError:
                _reached(self._client, False)
                logger.info("could not revoke lease %x: etcd is unreachable", self.lease_id, exc_info=True)
            except EtcdError:
                logger.debug("could not revoke lease %x", self.lease_id, exc_info=True)
