"""torchrun's ``RendezvousHandler`` in live recovery (``--rdzv-conf recovery=live``): one node, no rounds.

In live mode the training workers form their own job-wide process group through etcd
(:mod:`elastic.live`, under ``<key_prefix>/<run_id>/live/``, which the agent exports to them as
``ETRAIN_LIVE_PREFIX``); when a node dies or joins, the survivors re-form that group without being restarted.
torchrun's agents must then stay out of the way, so this handler gives each agent a world of its own node.

What torchrun still does in live mode, per node:

- starts this node's workers (``--nproc-per-node``) once the handler returns, which it does at once;
- restarts them (all of this node's workers) when one crashes, up to ``--max-restarts`` times, setting
  ``TORCHELASTIC_RESTART_COUNT``; the restarted workers re-join the live group on their own;
- waits for them, and exits with their result;
- forwards SIGTERM (and SIGINT, ...) it receives to its workers.

What it no longer does:

- no job-wide rounds: :meth:`LiveRendezvousHandler.next_rendezvous` waits for no other node;
- it never restarts survivors for a joiner or a lost node (:meth:`~LiveRendezvousHandler.num_nodes_waiting`
  is always 0): the workers re-form the group themselves;
- the ``WORLD_SIZE``/``RANK``/``GROUP_RANK``/``MASTER_ADDR`` it sets are node-local (this node's workers
  only, ``GROUP_RANK`` 0); the live group ignores them.

Kept from the ``etcd-v3`` handler (:class:`~elastic.rendezvous.agent.AgentLeases`): the agent's
presence key ``rdzv/alive/<node>`` on its ``node_ttl`` lease, and the run's ``closed`` key: an agent whose
workers finish, or fail past ``--max-restarts``, closes the run as torchrun's agents do, and
``next_rendezvous`` (a joiner, or a restart after a crash) then raises ``RendezvousClosedError``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import threading

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousHandler
from torch.distributed.elastic.rendezvous.api import RendezvousInfo

from elastic import compat
from elastic.etcd import EtcdClient
from elastic.rendezvous.agent import AgentLeases, shutdown_handler
from elastic.rendezvous.etcd_v3_handler import HandlerSettings
from elastic.rendezvous.etcd_v3_store import EtcdV3Store
from elastic.rendezvous.protocol import RendezvousKeys

logger = logging.getLogger(__name__)

__all__ = ["LiveRendezvousHandler"]

_LOCAL_IDS = itertools.count()


class LiveRendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` backend in live recovery: a node-local world at once (see the module docstring).

    Args:
        client: the etcd adapter.
        run_id: the job's run id.
        keys: the run's etcd layout.
        settings: ``node_ttl``, ``state_ttl`` and ``store_timeout`` are used (rounds and their rules are not).
        local_addr: this node's address (default: the host's FQDN), for the workers' node-local store.
        node_id: this agent's unique id (default ``<addr>:<pid>:live<n>``).
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        keys: RendezvousKeys,
        settings: HandlerSettings,
        *,
        local_addr: str | None = None,
        node_id: str | None = None,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._keys = keys
        self._addr = local_addr or socket.getfqdn()
        self._node = node_id or f"{self._addr}:{os.getpid()}:live{next(_LOCAL_IDS)}"
        if "/" in self._node:
            raise ValueError(f"a rendezvous node id must not contain '/': {self._node!r}")
        self._lock = threading.Lock()
        self._leases = AgentLeases(client, keys, self._node, settings.node_ttl, settings.state_ttl)
        self._store = EtcdV3Store(client, keys.store, timeout=settings.store_timeout, lease=self._leases.state_lease_id)
        self._calls = itertools.count()
        self._registered = False
        self._released = False

    # -- identity ------------------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._node

    @property
    def keys(self) -> RendezvousKeys:
        return self._keys

    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # the node's workers host their own TCPStore (see compat.disable_shared_rdzv_store)

    # -- presence ------------------------------------------------------------------------------------
    def register(self) -> None:
        """Announce this agent as alive (``alive/<node>`` on a ``node_ttl`` lease); idempotent."""
        self._leases.node_lease_id()
        with self._lock:
            if not self._registered:
                self._registered = True
                atexit.register(self.release)

    # -- the rendezvous ------------------------------------------------------------------------------
    def next_rendezvous(self) -> RendezvousInfo:
        """This node alone, at once: rank 0 of a world of 1 and a fresh store prefix per call.

        Raises ``RendezvousClosedError`` once the run is closed."""
        self.register()
        if self.is_closed():
            raise RendezvousClosedError()
        n = next(self._calls)
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.live.{self._node}.{n}", self._store)
        bootstrap = compat.rendezvous_store_info(0, store, self._addr)
        logger.info(
            "node %s starts its workers on its own (live recovery, run %s, start %d)", self._node, self._run_id, n
        )
        return RendezvousInfo(store, 0, 1, bootstrap)

    def num_nodes_waiting(self) -> int:
        """Always 0: neither a joiner nor a lost node restarts this node's workers (they re-form the live
        group themselves). Asks etcd nothing."""
        return 0

    # -- closing -------------------------------------------------------------------------------------
    def is_closed(self) -> bool:
        return self._leases.is_closed()

    def set_closed(self) -> None:
        self._leases.set_closed()

    def shutdown(self) -> bool:
        return shutdown_handler(self._run_id, self.set_closed, self.release)

    def release(self) -> None:
        """Revoke this agent's lease (its presence key vanishes at once); idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._leases.close()
        atexit.unregister(self.release)  # released: nothing left for exit, and the handler may be collected
