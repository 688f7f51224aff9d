"""torchrun's ``RendezvousHandler`` on etcd v3: one key per joiner, one closer per round, O(N) work.

The protocol and its etcd layout are in :mod:`elastic.rendezvous.protocol` (pure decisions) and
docs/rendezvous.md. This module does the participant's I/O: leases, the join and claim transactions,
waiting, membership, the watches; :mod:`elastic.rendezvous.closer` does the closer's.

Per participant and round: one join transaction, one read when the round's assignment appears, one watch
on its successor in rank order, and one read when a node asks for the next round: a constant, whatever N.
The closer additionally reads the join count when the run's rendezvous keys change and commits the
assignment once. Nothing here uses torch's private API.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousInfo

from elastic import compat
from elastic.contract.rendezvous import DEFAULTS
from elastic.etcd import (
    Compare,
    CompareTarget,
    DeleteOp,
    EtcdClient,
    EtcdLeaseNotFoundError,
    GetOp,
    PutOp,
    TxnOp,
    TxnResult,
)
from elastic.etcd.watch import SHARED_WATCHERS, RevisionWatcher
from elastic.rendezvous.agent import AgentLeases, shutdown_handler
from elastic.rendezvous.closer import SAFETY_POLL, RoundCloser
from elastic.rendezvous.etcd_calls import (
    LeaseRefresher,
    absent,
    compare,
    decode_assignment,
    parse_head,
    translate,
    txn,
    wrapped,
)
from elastic.rendezvous.etcd_v3_store import EtcdV3Store
from elastic.rendezvous.protocol import (
    NextRoundView,
    RendezvousKeys,
    RoundAssignment,
    RoundRules,
    waiting_reason,
)
from elastic.rendezvous.round import Membership, Outcome, next_round_view

logger = logging.getLogger(__name__)

__all__ = ["EtcdV3RendezvousHandler", "HandlerSettings"]

_LOCAL_IDS = itertools.count()


@dataclass(frozen=True)
class HandlerSettings:
    """Round rules and timeouts of the backend's handlers (defaults: :data:`elastic.contract.rendezvous.DEFAULTS`)."""

    rules: RoundRules
    node_ttl: timedelta = DEFAULTS.node_ttl
    state_ttl: timedelta = DEFAULTS.state_ttl
    join_timeout: timedelta = DEFAULTS.join_timeout
    store_timeout: timedelta = DEFAULTS.store_timeout
    min_wake_interval: timedelta = DEFAULTS.min_wake_interval


class EtcdV3RendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` rendezvous (see the module docstring and :mod:`elastic.rendezvous.protocol`).

    Args:
        client: the etcd adapter (may be shared by several handlers of one process).
        run_id: the job's run id.
        keys: the run's etcd layout.
        settings: round rules and timeouts.
        local_addr: this node's address (default: the host's FQDN), for rank 0's store address.
        node_id: this participant's unique id (default ``<addr>:<pid>:<n>``).
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
        self._settings = settings
        self._rules = settings.rules
        self._addr = local_addr or socket.getfqdn()
        self._node = node_id or f"{self._addr}:{os.getpid()}:{next(_LOCAL_IDS)}"
        if "/" in self._node:
            raise ValueError(f"a rendezvous node id must not contain '/': {self._node!r}")
        self._lock = threading.Lock()
        self._leases = AgentLeases(client, keys, self._node, settings.node_ttl, settings.state_ttl)
        self._rounds_watch: RevisionWatcher | None = None
        self._member: Membership | None = None
        self._last_round: int | None = None
        self._head_revision = 0  # the head's mod revision as of the newest round this node saw assigned
        self._released = False
        self._closer = RoundCloser(
            client,
            run_id,
            keys,
            self._rules,
            min_wake_interval=settings.min_wake_interval,
            state_lease=self.state_lease_id,
        )
        self._store = EtcdV3Store(client, keys.store, timeout=settings.store_timeout, lease=self.state_lease_id)

    # -- identity ------------------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self._node

    @property
    def keys(self) -> RendezvousKeys:
        return self._keys

    @property
    def store(self) -> EtcdV3Store:
        return self._store

    @property
    def round(self) -> int | None:
        """The round this node is a member of (None before its first rendezvous)."""
        member = self._member
        return member.round if member is not None else None

    @property
    def assignment(self) -> RoundAssignment | None:
        member = self._member
        return member.assignment if member is not None else None

    def joined(self, round_: int) -> int:
        """How many nodes have joined ``round_`` so far (for tests and benchmarks)."""
        res = self._txn([], [GetOp(self._keys.joins(round_), prefix=True, count_only=True)])
        return res.get(0).count

    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # each round's workers host their own TCPStore (see compat.disable_shared_rdzv_store)

    # -- leases --------------------------------------------------------------------------------------
    def register(self) -> None:
        """Announce this agent as alive (``alive/<node>`` on a ``node_ttl`` lease); idempotent."""
        self._node_lease_id()

    def _node_lease_id(self) -> int:
        return self._leases.node_lease_id()

    def _replace_node_lease(self, lost: int) -> int:
        return self._leases.replace_node_lease(lost)

    def state_lease_id(self) -> int:
        """The long lease that rounds, the head and the store hang on (abandoned state expires by itself)."""
        return self._leases.state_lease_id()

    # -- the rendezvous ------------------------------------------------------------------------------
    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._settings.join_timeout.total_seconds()
        logger.info("node %s joins the next round of rendezvous %s", self._node, self._run_id)
        previous = self._leave_round()
        lease = self._node_lease_id()
        # Where to join: after the round this node left, or (new to the run) round 0 while none is assigned.
        # The join transaction is fenced on the head it expects; if a round formed since, it learns the
        # newest and joins the one after it.
        round_ = previous + 1 if previous is not None else 0
        spare = False
        while True:
            outcome = self._join_and_wait(round_, previous, lease, deadline, spare)
            assignment = outcome.assignment
            rank = assignment.rank(self._node)
            if rank is not None:
                break
            # More joined than max_nodes and this node came late: a spare for the next round.
            logger.info(
                "round %d is full without node %s: waiting for round %d",
                assignment.round,
                self._node,
                assignment.round + 1,
            )
            self._txn([], [DeleteOp(self._keys.join_key(assignment.round, self._node))])
            round_, previous, spare = assignment.round + 1, None, True
        self._become_member(outcome)
        world = len(assignment.members)
        logger.info(
            "node %s joined round %d of rendezvous %s as rank %d in a world of size %d",
            self._node,
            assignment.round,
            self._run_id,
            rank,
            world,
        )
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{assignment.round}", self._store)
        bootstrap = compat.rendezvous_store_info(rank, store, self._addr)
        return RendezvousInfo(store, rank, world, bootstrap)

    def _join_and_wait(self, round_: int, previous: int | None, lease: int, deadline: float, spare: bool) -> Outcome:
        """Join ``round_`` (or the first later one still forming) and return the round's assignment.

        A spare (this node was left out of a full round, or the run's newest round is full as it arrives)
        waits for room without ``join_timeout``, like torch's redundancy list."""
        keys = self._keys
        head_rev = self._head_revision if previous is not None else 0
        lease_retries = 3
        while True:
            value = json.dumps({"addr": self._addr, "pid": os.getpid()}).encode()
            ops: list[TxnOp] = [PutOp(keys.join_key(round_, self._node), value, lease=lease)]
            if previous is not None:
                # Leaving a round: its members are told at once (they watch round `previous + 1`).
                ops += [
                    DeleteOp(keys.join_key(previous, self._node)),
                    PutOp(keys.wake(previous + 1), self._node.encode(), lease=self.state_lease_id()),
                ]
            ops.append(GetOp(keys.closer(round_)))
            try:
                res = self._client.txn(
                    [compare(keys.head, CompareTarget.MOD, head_rev), absent(keys.closed)],
                    ops,
                    [GetOp(keys.closed, keys_only=True), GetOp(keys.head)],
                )
            except EtcdLeaseNotFoundError as exc:
                if lease_retries == 0:
                    raise translate(exc) from exc
                # the node lease lapsed (etcd overloaded or unreachable for node_ttl): a new one, and again
                lease_retries -= 1
                lease = self._replace_node_lease(lease)
                continue
            if res.succeeded:
                break
            closed, head = res.reads()
            if closed.kvs:
                raise RendezvousClosedError()
            if not head.kvs:
                head_rev, round_ = 0, max(round_, 0)  # the head expired with an abandoned run
                continue
            head_kv = head.kvs[0]
            newest = parse_head(head_kv.value)
            head_rev, round_ = head_kv.mod_revision, max(round_, newest.round + 1)
            if previous is None and newest.size >= self._rules.max_nodes:
                spare = True
        self._ensure_rounds_watch(res.revision + 1)
        if spare:
            logger.info("node %s waits as a spare for round %d (the newest round is full)", self._node, round_)
        wait_until: float | None = None if spare else deadline
        self._last_round = round_
        [closer] = res.reads()  # the success branch's one read, after its writes
        closer_present = bool(closer.kvs)
        seen = res.revision
        while True:
            if not closer_present:
                outcome = self._try_to_close(round_, wait_until)
                if outcome is not None:
                    return outcome
            remaining = SAFETY_POLL if wait_until is None else wait_until - time.monotonic()
            if remaining <= 0:
                self._abandon(round_)
                raise RendezvousTimeoutError(
                    f"round {round_} of rendezvous {self._run_id} did not complete within "
                    f"{self._settings.join_timeout.total_seconds():g}s (join_timeout)"
                )
            assert self._rounds_watch is not None
            self._rounds_watch.wait_beyond(seen, timedelta(seconds=min(remaining, SAFETY_POLL)))
            res = self._txn(
                [],
                [
                    GetOp(keys.round(round_), prefix=True),
                    GetOp(keys.closed, keys_only=True),
                    GetOp(keys.round(round_ + 1), prefix=True, keys_only=True),
                ],
            )
            seen = res.revision
            this_round, closed, next_round = res.reads()
            if closed.kvs:
                self._abandon(round_)
                raise RendezvousClosedError()
            found = {kv.key: kv for kv in this_round.kvs}
            if keys.assign(round_) in found:
                following = {kv.key for kv in next_round.kvs}
                nxt = next_round_view(keys, round_ + 1, following, closed=False)
                kv = found[keys.assign(round_)]
                return Outcome(self._decode(kv.value), nxt, res.revision, kv.mod_revision)
            closer_present = keys.closer(round_) in found

    # -- the closer ----------------------------------------------------------------------------------
    def _try_to_close(self, round_: int, deadline: float | None) -> Outcome | None:
        """Claim the closer's key of ``round_``; if claimed, complete the round (or hand it over)."""
        keys = self._keys
        claim = self._txn(
            [absent(keys.closer(round_)), absent(keys.assign(round_))],
            [PutOp(keys.closer(round_), self._node.encode(), lease=self._node_lease_id())],
            [],
        )
        if not claim.succeeded:
            return None
        logger.debug("node %s closes round %d", self._node, round_)
        try:
            return self._closer.close(round_, claim.revision, deadline)
        except RendezvousClosedError:
            self._abandon(round_)
            raise

    # -- membership ----------------------------------------------------------------------------------
    def _become_member(self, outcome: Outcome) -> None:
        assignment = outcome.assignment
        self._head_revision = outcome.head_revision
        successor = assignment.successor(self._node)
        watch = None
        if successor is not None:
            key = self._keys.join_key(assignment.round, successor)
            watch = RevisionWatcher(self._client, key, assignment.fence + 1, is_prefix=False)
        refresher = None
        if assignment.lease:
            interval = max(self._settings.state_ttl.total_seconds() / 3, 1.0)
            refresher = LeaseRefresher(self._client, assignment.lease, interval)
        self._member = Membership(
            assignment=assignment,
            successor=watch,
            refresher=refresher,
            next_seen=outcome.revision,
            next_round=outcome.next_round or NextRoundView(closer=False, wake=False, assigned=False, closed=False),
        )
        if outcome.next_round is None:
            self._refresh_next_round(self._member)

    def _refresh_next_round(self, member: Membership) -> None:
        keys, nxt = self._keys, member.round + 1
        res = self._txn([], [GetOp(keys.round(nxt), prefix=True, keys_only=True), GetOp(keys.closed, keys_only=True)])
        member.next_seen = res.revision
        following, closed = res.reads()
        member.next_round = next_round_view(keys, nxt, {kv.key for kv in following.kvs}, bool(closed.kvs))

    def num_nodes_waiting(self) -> int:
        """1 when this node's round should re-form (see :func:`protocol.waiting_reason`), else 0.

        Served from watches: etcd is read only after a key of the run's rounds changed.
        """
        member, watch = self._member, self._rounds_watch
        if member is None or watch is None:
            return 0
        lost = member.successor_lost()
        try:
            if watch.latest > member.next_seen:
                self._refresh_next_round(member)
            if lost and not member.wake_sent:
                # This node is the one that saw the loss: ask every member to re-form.
                wake = PutOp(self._keys.wake(member.round + 1), self._node.encode(), lease=self.state_lease_id())
                self._txn([], [wake])
                member.wake_sent = True
        except RendezvousConnectionError as exc:
            # etcd unreachable: keep the last view (an outage alone must not restart training)
            logger.debug("rendezvous %s: could not read the next round (%s)", self._run_id, exc)
        reason = waiting_reason(len(member.assignment.members), self._rules.max_nodes, member.next_round, lost)
        if reason is None:
            return 0
        if reason != member.reported:
            logger.warning("round %d of %s re-forms: %s", member.round, self._run_id, reason)
            member.reported = reason
        return 1

    def _leave_round(self) -> int | None:
        member, self._member = self._member, None
        if member is not None:
            member.close()
            return member.round
        return self._last_round

    def _abandon(self, round_: int) -> None:
        try:
            self._txn([], [DeleteOp(self._keys.join_key(round_, self._node))])
        except RendezvousConnectionError:
            logger.debug("could not withdraw from round %d", round_, exc_info=True)

    # -- closing -------------------------------------------------------------------------------------
    def is_closed(self) -> bool:
        return self._leases.is_closed()

    def set_closed(self) -> None:
        self._leases.set_closed()

    def shutdown(self) -> bool:
        return shutdown_handler(self._run_id, self.set_closed, self.release)

    def release(self) -> None:
        """Stop the watches and revoke this node's lease (its keys vanish at once); idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            watch = self._rounds_watch
        member, self._member = self._member, None
        if member is not None:
            member.close()
        if watch is not None:
            SHARED_WATCHERS.release(self._client, self._keys.rounds, watch)
        self._leases.close()
        atexit.unregister(self.release)  # released: nothing left for exit, and the handler may be collected

    # -- helpers -------------------------------------------------------------------------------------
    def _ensure_rounds_watch(self, start_revision: int) -> None:
        with self._lock:
            if self._rounds_watch is None:
                self._rounds_watch = SHARED_WATCHERS.acquire(self._client, self._keys.rounds, start_revision)
                atexit.register(self.release)

    def _decode(self, raw: bytes) -> RoundAssignment:
        return decode_assignment(self._run_id, raw)

    def _txn(self, compares: list[Compare], success: list[TxnOp], failure: list[TxnOp] | None = None) -> TxnResult:
        return txn(self._client, compares, success, failure or [])

    def _wrap(self, fn: Any) -> Any:
        return wrapped(fn)
