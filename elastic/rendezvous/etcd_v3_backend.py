"""A torch ``RendezvousBackend`` that keeps the rendezvous state in etcd over the v3 API.

Keys (under ``<key_prefix>/<run_id>/rdzv/``; the run's store lives beside them under ``store/``):

``state``
    The state blob written by torch's ``DynamicRendezvousHandler``, framed as
    ``MAGIC | sha256[:8] | payload``. The key's etcd *mod revision* is the fencing token: ``set_state``
    is one transaction that writes only if the revision is unchanged, and otherwise returns the current
    state. The key is attached to a long lease (``state_ttl``, default 2 h) that every live agent keeps
    refreshing, so state abandoned by all agents expires by itself.
``alive/<addr>:<pid>``
    One key per agent process, attached to a short lease (``node_ttl``, default 2 s). Its presence is
    how other agents learn, within the TTL, that the agent lives; a SIGKILLed agent's key vanishes when
    its lease expires, and a clean shutdown revokes the lease at once.

Liveness from leases replaces torch's heartbeat timeout (keep-alive interval x attempts, 15 s by
default) in the state that ``get_state``/``set_state`` hand back: a node whose agent has no ``alive``
key at the revision read is shown with an expired heartbeat (torch then removes it), and one that has
a key is shown as freshly heard from. And when a re-formed round (round > 0) already holds every live
agent of the run, its last-call deadline is shown as passed: a scale-down or scale-up completes at once
instead of waiting ``last_call_timeout`` for agents that are known not to exist.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import random
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError, KeyValue
from elastic.etcd.lease import LeaseKeeper
from elastic.etcd.watch import RevisionWatcher

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KEY_PREFIX", "EtcdV3RendezvousBackend"]

DEFAULT_KEY_PREFIX = "/torchelastic/rdzv"
_MAGIC = b"ETV3\x01"
_DIGEST = 8
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _frame(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).digest()[:_DIGEST] + payload


def _unframe(blob: bytes) -> bytes:
    head = len(_MAGIC) + _DIGEST
    if len(blob) < head or not blob.startswith(_MAGIC):
        raise RendezvousStateError("The rendezvous state in etcd is corrupt: unknown framing.")
    digest, payload = blob[len(_MAGIC) : head], blob[head:]
    if hashlib.sha256(payload).digest()[:_DIGEST] != digest:
        raise RendezvousStateError("The rendezvous state in etcd is corrupt: checksum mismatch.")
    return payload


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd v3, fenced by the state key's mod revision (see the module docstring).

    Args:
        client: the etcd adapter to use.
        run_id: the rendezvous run id (the job); must be non-empty.
        key_prefix: where run ids live in etcd.
        state_ttl: how long state survives after the last agent stops refreshing it.
        node_ttl: lease TTL of each agent's ``alive`` key (failure detection time).
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        state_ttl: timedelta = timedelta(hours=2),
        node_ttl: timedelta = timedelta(seconds=2),
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if "/" in run_id:
            raise ValueError(f"The run id must not contain '/': {run_id!r}")
        self._client = client
        self._run_id = run_id
        self._base = f"{key_prefix.rstrip('/')}/{run_id}/"
        self._rdzv_prefix = self._base + "rdzv/"
        self._state_key = self._rdzv_prefix + "state"
        self._alive_prefix = self._rdzv_prefix + "alive/"
        self._last_revision = 0
        self._backoff = 0.005
        self._state_ttl = state_ttl
        self._node_ttl = node_ttl
        self._lock = threading.Lock()
        self._state_lease: LeaseKeeper | None = None
        self._node_lease: LeaseKeeper | None = None
        self._node_key: str | None = None
        self._watcher: RevisionWatcher | None = None

    # -- identity and leases -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return "etcd-v3"

    @property
    def key_base(self) -> str:
        """The etcd prefix of this run (``<key_prefix>/<run_id>/``)."""
        return self._base

    @property
    def state_key(self) -> str:
        """The etcd key holding the framed rendezvous state."""
        return self._state_key

    def state_lease_id(self) -> int:
        """The long lease that state and store keys are attached to (granted on first use)."""
        with self._lock:
            if self._state_lease is None:
                self._state_lease = self._wrap(
                    lambda: LeaseKeeper(self._client, self._state_ttl, name="rdzv-state")
                )
            return self._state_lease.lease_id

    def register_node(self, addr: str, pid: int) -> None:
        """Announce this agent process as alive (``alive/<addr>:<pid>`` on a ``node_ttl`` lease)."""
        key = f"{self._alive_prefix}{addr}:{pid}"

        def attach(lease_id: int) -> None:
            self._client.put(key, b"1", lease=lease_id)

        with self._lock:
            if self._node_lease is not None:
                return
            self._node_key = key
            self._node_lease = self._wrap(
                lambda: LeaseKeeper(self._client, self._node_ttl, on_new_lease=attach, name="rdzv-node")
            )
        logger.info("registered %s with a %ss lease", key, self._node_ttl.total_seconds())

    def close(self) -> None:
        """Revoke this process's leases (its ``alive`` key disappears at once)."""
        with self._lock:
            node, state, watcher = self._node_lease, self._state_lease, self._watcher
            self._node_lease = self._state_lease = None
            self._watcher = None
        if watcher is not None:
            watcher.close()
        if node is not None:
            node.close()
        if state is not None:
            # Keys on the state lease must outlive a clean exit of one agent; others refresh their own
            # lease on their next write, so only stop refreshing ours.
            state.close(revoke=False)

    # -- RendezvousBackend ---------------------------------------------------------------------------
    def get_state(self) -> tuple[bytes, Token] | None:
        kv, alive, revision = self._wrap(lambda: self._client.get_with_prefix(self._state_key, self._alive_prefix))
        self._seen(revision)
        if kv is None:
            return None
        return self._decode(kv, alive), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        expected = 0
        if token is not None:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                return self._current_as_failed()
            if expected <= 0:
                return self._current_as_failed()
        lease = self.state_lease_id()
        ok, kv, alive, revision = self._wrap(
            lambda: self._client.compare_and_put(
                self._state_key,
                _frame(state),
                mod_revision=expected,
                lease=lease,
                read_prefix=self._alive_prefix,
            )
        )
        self._seen(revision)
        if not ok:
            # Lost a race: back off a little, at random, so that many nodes joining at once do not
            # retry in lock-step (each success would otherwise fail every other writer again).
            time.sleep(random.uniform(0, self._backoff))
            self._backoff = min(self._backoff * 2, 0.1)
        else:
            self._backoff = 0.005
        if kv is None:
            return None
        return self._decode(kv, alive), kv.mod_revision, ok

    def wait_for_change(self, timeout: timedelta) -> bool:
        """Block until the run's rendezvous keys (state, liveness) change after the last read, or
        ``timeout`` passes; True on a change. Replaces torch's fixed 1 s polling while waiting."""
        with self._lock:
            if self._watcher is None:
                self._watcher = RevisionWatcher(self._client, self._rdzv_prefix, self._last_revision + 1)
            watcher, seen = self._watcher, self._last_revision
        return watcher.wait_beyond(seen, timeout)

    # -- helpers -------------------------------------------------------------------------------------
    def _seen(self, revision: int) -> None:
        with self._lock:
            self._last_revision = max(self._last_revision, revision)

    def _current_as_failed(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], False

    def _wrap(self, fn: Any) -> Any:
        try:
            return fn()
        except EtcdConnectionError as exc:
            raise RendezvousConnectionError(f"The connection to etcd has failed: {exc}") from exc
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd rejected a rendezvous request: {exc}") from exc

    def _decode(self, kv: KeyValue, alive_kvs: list[KeyValue]) -> bytes:
        payload = _unframe(kv.value)
        if self._node_lease is None:
            return payload  # liveness is only applied for registered agents
        alive = {k.key[len(self._alive_prefix) :] for k in alive_kvs}
        return _apply_liveness(payload, alive)


def _apply_liveness(payload: bytes, alive: set[str]) -> bytes:
    """Rewrite heartbeats (and, for re-formed rounds, the last-call deadline) from lease liveness."""
    try:
        state = pickle.loads(payload)
        heartbeats: dict[Any, datetime] = state.last_heartbeats
        participants: dict[Any, int] = state.participants
    except Exception:
        return payload  # not torch's state object: nothing to adjust
    now = datetime.now(timezone.utc)
    changed = False
    for node in list(heartbeats):
        ident = f"{node.addr}:{node.pid}"
        if ident in alive:
            if heartbeats[node] < now:
                heartbeats[node] = now
                changed = True
        elif heartbeats[node] != _EPOCH:
            heartbeats[node] = _EPOCH
            changed = True
    live_participants = {f"{n.addr}:{n.pid}" for n in participants} & alive
    if (
        not state.complete
        and not state.closed
        and state.round > 0
        and state.deadline is not None
        and state.deadline > now
        and alive
        and alive <= live_participants
    ):
        state.deadline = now - timedelta(seconds=1)
        changed = True
    return pickle.dumps(state) if changed else payload
