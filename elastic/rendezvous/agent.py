"""What an agent keeps across the rounds of one run, shared by the backend's handlers (the ``etcd-v3``
handler, :mod:`elastic.rendezvous.etcd_v3_handler`, and the live one, :mod:`elastic.rendezvous.live_handler`):
its two leases, the run's ``closed`` key, and the rule of ``shutdown()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic import compat
from elastic.etcd import EtcdClient, GetOp, PutOp
from elastic.etcd.lease import LeaseKeeper
from elastic.rendezvous.etcd_calls import txn, wrapped
from elastic.rendezvous.protocol import RendezvousKeys

logger = logging.getLogger(__name__)

__all__ = ["AgentLeases", "shutdown_handler"]


class AgentLeases:
    """One agent's two leases in a run, and the run's ``closed`` key: what the backend's handlers share.

    The node lease (``node_ttl``) carries ``alive/<node>``, the agent's presence (re-written on a new
    lease if etcd lost the old one); the state lease (``state_ttl``) carries the store's keys and
    ``closed``. Both are granted on first use; :meth:`close` revokes the node lease (the agent's keys
    vanish at once) and leaves the state lease to expire (the store outlives one agent's clean exit).
    """

    def __init__(
        self, client: EtcdClient, keys: RendezvousKeys, node: str, node_ttl: timedelta, state_ttl: timedelta
    ) -> None:
        self._client = client
        self._keys = keys
        self._node = node
        self._node_ttl = node_ttl
        self._state_ttl = state_ttl
        self._lock = threading.Lock()
        self._node_lease: LeaseKeeper | None = None
        self._state_lease: LeaseKeeper | None = None

    def node_lease_id(self) -> int:
        """The node lease, granted (and ``alive/<node>`` put on it) on first use."""
        with self._lock:
            if self._node_lease is None:
                key = self._keys.alive_key(self._node)

                def attach(lease_id: int) -> None:
                    self._client.put(key, b"1", lease=lease_id)

                self._node_lease = wrapped(
                    lambda: LeaseKeeper(self._client, self._node_ttl, on_new_lease=attach, name="rdzv-node")
                )
                logger.info("registered %s with a %gs lease", key, self._node_ttl.total_seconds())
            return self._node_lease.lease_id

    def replace_node_lease(self, lost: int) -> int:
        """etcd said the node lease ``lost`` is gone: a new one (``alive/<node>`` re-written on it)."""
        with self._lock:
            keeper = self._node_lease
        if keeper is None:
            return self.node_lease_id()
        lease = wrapped(lambda: keeper.replace_lost(lost))
        logger.warning("node %s: its lease %x was gone; joining on a new one (%x)", self._node, lost, lease)
        return lease

    def state_lease_id(self) -> int:
        """The long lease that rounds, the head and the store hang on (abandoned state expires by itself)."""
        with self._lock:
            if self._state_lease is None:
                self._state_lease = wrapped(lambda: LeaseKeeper(self._client, self._state_ttl, name="rdzv-state"))
            return self._state_lease.lease_id

    def is_closed(self) -> bool:
        return bool(txn(self._client, [], [GetOp(self._keys.closed, keys_only=True)]).get(0).kvs)

    def set_closed(self) -> None:
        txn(self._client, [], [PutOp(self._keys.closed, b"1", lease=self.state_lease_id())])

    def close(self) -> None:
        """Revoke the node lease, stop refreshing the state lease (see the class docstring)."""
        with self._lock:
            node, state = self._node_lease, self._state_lease
        if node is not None:
            node.close()
        if state is not None:
            state.close(revoke=False)  # rounds and store outlive one agent's clean exit


def shutdown_handler(run_id: str, set_closed: Callable[[], None], release: Callable[[], None]) -> bool:
    """``RendezvousHandler.shutdown()`` of the backend's handlers: close the run (``set_closed``) unless a
    signal stops the agent, then ``release`` the handler in any case; False when etcd could not be told."""
    try:
        if compat.shutdown_on_death_signal():
            # torch 2.6's agent closes the rendezvous when a signal stops it; torch's launcher and later
            # agents leave it open, so that the other nodes re-form without this one: do as they do.
            logger.info("stopped by a signal: leaving the rendezvous open for the other nodes")
            return True
        try:
            set_closed()
        except RendezvousConnectionError:
            logger.warning("could not close rendezvous %s", run_id, exc_info=True)
            return False
        return True
    finally:
        release()
