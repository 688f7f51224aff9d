"""torchrun's ``RendezvousHandler`` on etcd v3: one key per joiner, one closer per round, O(N) work.

The protocol and its etcd layout are in :mod:`elastic.rendezvous.protocol` (pure decisions) and
docs/rendezvous.md. This module does the I/O: leases, the join and close transactions, the watches.

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
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousInfo

from elastic import compat
from elastic.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    EtcdClient,
    EtcdConnectionError,
    EtcdError,
    GetOp,
    PutOp,
    TxnOp,
    TxnResult,
)
from elastic.etcd.lease import LeaseKeeper
from elastic.etcd.watch import SHARED_WATCHERS, RevisionWatcher
from elastic.rendezvous.etcd_v3_store import EtcdV3Store
from elastic.rendezvous.protocol import (
    Assignment,
    CloseNow,
    FormingView,
    Head,
    NextRoundView,
    RendezvousKeys,
    RoundRules,
    close_decision,
    previous_round_full,
    select_members,
    waiting_reason,
)

logger = logging.getLogger(__name__)

__all__ = ["EtcdV3RendezvousHandler", "HandlerSettings"]

_LOCAL_IDS = itertools.count()
#: The longest a waiter goes without reading the round's keys, should a watch event be missed.
_SAFETY_POLL = 5.0


@dataclass(frozen=True)
class HandlerSettings:
    rules: RoundRules
    node_ttl: timedelta = timedelta(seconds=2)
    state_ttl: timedelta = timedelta(hours=2)
    join_timeout: timedelta = timedelta(seconds=600)
    store_timeout: timedelta = timedelta(seconds=300)
    min_wake_interval: timedelta = timedelta(seconds=0.05)


@dataclass
class _Membership:
    """This node's place in a completed round, and what it has seen of the next one."""

    assignment: Assignment
    successor: RevisionWatcher | None
    refresher: _LeaseRefresher | None
    next_seen: int
    next_round: NextRoundView
    wake_sent: bool = False
    reported: str | None = None

    @property
    def round(self) -> int:
        return self.assignment.round

    def successor_lost(self) -> bool:
        return self.successor is not None and self.successor.latest > self.assignment.fence

    def close(self) -> None:
        if self.successor is not None:
            self.successor.close()
        if self.refresher is not None:
            self.refresher.close()


@dataclass(frozen=True)
class _Outcome:
    """A round's assignment, and what was seen of the next round in the same read (None: not read)."""

    assignment: Assignment
    next_round: NextRoundView | None
    revision: int
    head_revision: int  # the revision that assigned the round (it wrote the head too)


def _next_round_view(keys: RendezvousKeys, round_: int, present: set[str], closed: bool) -> NextRoundView:
    return NextRoundView(
        closer=keys.closer(round_) in present,
        wake=keys.wake(round_) in present,
        assigned=keys.assign(round_) in present,
        closed=closed,
    )


def _cmp(
    key: str, target: CompareTarget, value: int, *, op: CompareOp = CompareOp.EQUAL, prefix: bool = False
) -> Compare:
    return Compare(key, target, op, value, prefix=prefix)


def _translate(exc: EtcdError) -> RendezvousConnectionError:
    if isinstance(exc, EtcdConnectionError):
        return RendezvousConnectionError(f"The connection to etcd has failed: {exc}")
    return RendezvousConnectionError(f"etcd rejected a rendezvous request: {exc}")


def _absent(key: str) -> Compare:
    return _cmp(key, CompareTarget.CREATE, 0)


def _head(raw: bytes) -> Head:
    try:
        return Head.decode(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"the rendezvous in etcd is corrupt: {exc}") from exc


class _LeaseRefresher:
    """Keeps a lease that another process granted alive (the round's keys outlive their closer)."""

    def __init__(self, client: EtcdClient, lease_id: int, interval: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(client, lease_id, interval), name="rdzv-round-lease", daemon=True
        )
        self._thread.start()

    def _run(self, client: EtcdClient, lease_id: int, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                if client.keep_alive_once(lease_id) <= 0:
                    return  # gone: the next round writes its keys on a new lease
            except EtcdError:
                logger.debug("could not refresh the round's lease %x", lease_id, exc_info=True)

    def close(self) -> None:
        self._stop.set()


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
        self._node_lease: LeaseKeeper | None = None
        self._state_lease: LeaseKeeper | None = None
        self._rounds_watch: RevisionWatcher | None = None
        self._member: _Membership | None = None
        self._last_round: int | None = None
        self._head_revision = 0  # the head's mod revision as of the newest round this node saw assigned
        self._released = False
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
    def assignment(self) -> Assignment | None:
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
        with self._lock:
            if self._node_lease is None:
                key = self._keys.alive_key(self._node)

                def attach(lease_id: int) -> None:
                    self._client.put(key, b"1", lease=lease_id)

                self._node_lease = self._wrap(
                    lambda: LeaseKeeper(self._client, self._settings.node_ttl, on_new_lease=attach, name="rdzv-node")
                )
                logger.info("registered %s with a %gs lease", key, self._settings.node_ttl.total_seconds())
            return self._node_lease.lease_id

    def _replace_node_lease(self, lost: int) -> int:
        with self._lock:
            keeper = self._node_lease
        if keeper is None:
            return self._node_lease_id()
        lease: int = self._wrap(lambda: keeper.replace_lost(lost))
        logger.warning("node %s: its lease %x was gone; joining on a new one (%x)", self._node, lost, lease)
        return lease

    def state_lease_id(self) -> int:
        """The long lease that rounds, the head and the store hang on (abandoned state expires by itself)."""
        with self._lock:
            if self._state_lease is None:
                self._state_lease = self._wrap(
                    lambda: LeaseKeeper(self._client, self._settings.state_ttl, name="rdzv-state")
                )
            return self._state_lease.lease_id

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
            self._node, assignment.round, self._run_id, rank, world,
        )  # fmt: skip
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{assignment.round}", self._store)
        bootstrap = compat.rendezvous_store_info(rank, store, self._addr)
        return RendezvousInfo(store, rank, world, bootstrap)

    def _join_and_wait(self, round_: int, previous: int | None, lease: int, deadline: float, spare: bool) -> _Outcome:
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
                    [_cmp(keys.head, CompareTarget.MOD, head_rev), _absent(keys.closed)],
                    ops,
                    [GetOp(keys.closed, keys_only=True), GetOp(keys.head)],
                )
            except EtcdError as exc:
                if "lease not found" not in str(exc) or lease_retries == 0:
                    raise _translate(exc) from exc
                # the node lease lapsed (etcd overloaded or unreachable for node_ttl): a new one, and again
                lease_retries -= 1
                lease = self._replace_node_lease(lease)
                continue
            if res.succeeded:
                break
            if res.get(0).kvs:
                raise RendezvousClosedError()
            if not res.get(1).kvs:
                head_rev, round_ = 0, max(round_, 0)  # the head expired with an abandoned run
                continue
            head_kv = res.get(1).kvs[0]
            newest = _head(head_kv.value)
            head_rev, round_ = head_kv.mod_revision, max(round_, newest.round + 1)
            if previous is None and newest.size >= self._rules.max_nodes:
                spare = True
        self._ensure_rounds_watch(res.revision + 1)
        if spare:
            logger.info("node %s waits as a spare for round %d (the newest round is full)", self._node, round_)
        wait_until: float | None = None if spare else deadline
        self._last_round = round_
        closer_present = bool(res.get(len(ops) - 1).kvs)
        seen = res.revision
        while True:
            if not closer_present:
                outcome = self._try_to_close(round_, wait_until)
                if outcome is not None:
                    return outcome
            remaining = _SAFETY_POLL if wait_until is None else wait_until - time.monotonic()
            if remaining <= 0:
                self._abandon(round_)
                raise RendezvousTimeoutError(
                    f"round {round_} of rendezvous {self._run_id} did not complete within "
                    f"{self._settings.join_timeout.total_seconds():g}s (join_timeout)"
                )
            assert self._rounds_watch is not None
            self._rounds_watch.wait_beyond(seen, timedelta(seconds=min(remaining, _SAFETY_POLL)))
            res = self._txn(
                [],
                [
                    GetOp(keys.round(round_), prefix=True),
                    GetOp(keys.closed, keys_only=True),
                    GetOp(keys.round(round_ + 1), prefix=True, keys_only=True),
                ],
            )
            seen = res.revision
            if res.get(1).kvs:
                self._abandon(round_)
                raise RendezvousClosedError()
            found = {kv.key: kv for kv in res.get(0).kvs}
            if keys.assign(round_) in found:
                following = {kv.key for kv in res.get(2).kvs}
                nxt = _next_round_view(keys, round_ + 1, following, closed=False)
                kv = found[keys.assign(round_)]
                return _Outcome(self._decode(kv.value), nxt, res.revision, kv.mod_revision)
            closer_present = keys.closer(round_) in found

    # -- the closer ----------------------------------------------------------------------------------
    def _try_to_close(self, round_: int, deadline: float | None) -> _Outcome | None:
        """Claim the closer's key of ``round_``; if claimed, complete the round (or hand it over)."""
        keys = self._keys
        claim = self._txn(
            [_absent(keys.closer(round_)), _absent(keys.assign(round_))],
            [PutOp(keys.closer(round_), self._node.encode(), lease=self._node_lease_id())],
            [],
        )
        if not claim.succeeded:
            return None
        logger.debug("node %s closes round %d", self._node, round_)
        return self._close_round(round_, claim.revision, deadline)

    def _close_round(self, round_: int, claimed_at: int, deadline: float | None) -> _Outcome | None:
        keys = self._keys
        watcher = RevisionWatcher(self._client, keys.rdzv, claimed_at + 1)
        try:
            last_joined, last_growth, last_wake, was_full = 0, None, 0.0, False
            while True:
                res = self._txn(
                    [],
                    [
                        GetOp(keys.joins(round_), prefix=True, count_only=True),
                        GetOp(keys.alive, prefix=True, count_only=True),
                        GetOp(keys.assign(round_)),
                        GetOp(keys.closer(round_)),
                        GetOp(keys.closed),
                        GetOp(keys.head),
                        GetOp(keys.joins(round_ - 1), prefix=True, count_only=True),
                    ],
                )
                if res.get(4).kvs:
                    self._abandon(round_)
                    raise RendezvousClosedError()
                if res.get(2).kvs:
                    kv = res.get(2).kvs[0]
                    return _Outcome(self._decode(kv.value), None, res.revision, kv.mod_revision)
                closer = res.get(3).kvs
                if not closer or closer[0].create_revision != claimed_at:
                    return None  # this node's lease lapsed and another took over
                joined, alive = res.get(0).count, res.get(1).count
                head = _head(res.get(5).kvs[0].value) if res.get(5).kvs else None
                full = previous_round_full(head, round_, res.get(6).count, self._rules)
                now = time.monotonic()
                if (joined > last_joined or was_full) and joined >= self._rules.min_nodes:
                    last_growth = now  # the last call runs from the latest join, or from when room appeared
                last_joined, was_full = joined, full
                view = FormingView(round_, joined, alive, last_growth, previous_full=full)
                decision = close_decision(view, now, self._rules)
                if isinstance(decision, CloseNow):
                    outcome = self._commit(round_, claimed_at)
                    if outcome is not None:
                        logger.info("round %d of %s complete: %s", round_, self._run_id, decision.reason)
                        return outcome
                    continue  # a join or a close slipped in: read again
                if deadline is not None and now >= deadline:
                    return None  # the caller raises the timeout
                wait = _SAFETY_POLL if deadline is None else min(deadline - now, _SAFETY_POLL)
                if decision.deadline is not None:
                    wait = min(wait, max(decision.deadline - now, 0.0))
                spacing = last_wake + self._settings.min_wake_interval.total_seconds() - time.monotonic()
                if spacing > 0:
                    time.sleep(spacing)  # with many joining, batch their joins into one read
                watcher.wait_beyond(res.revision, timedelta(seconds=wait))
                last_wake = time.monotonic()
        finally:
            watcher.close()

    def _commit(self, round_: int, claimed_at: int) -> _Outcome | None:
        """Assign ranks to the round's joiners in one transaction, fenced: it applies only if no join came
        after the read, this node still holds the closer's key and the round is not assigned."""
        keys = self._keys
        read = self._txn([], [GetOp(keys.joins(round_), prefix=True)])
        prefix = keys.joins(round_)
        joins = [(kv.key[len(prefix) :], kv.create_revision) for kv in read.get(0).kvs]
        members = select_members(joins, self._rules.max_nodes)
        if len(members) < self._rules.min_nodes:
            return None
        state = self.state_lease_id()
        assignment = Assignment(round_, members, fence=read.revision, lease=state)
        ops: list[TxnOp] = [
            PutOp(keys.assign(round_), assignment.encode(), lease=state),
            PutOp(keys.head, Head(round_, len(members)).encode(), lease=state),
        ]
        if round_ >= 2:  # two rounds back nobody is left: drop them
            ops += [DeleteOp(keys.round(round_ - 2), prefix=True), DeleteOp(keys.joins(round_ - 2), prefix=True)]
        res = self._txn(
            [
                _absent(keys.assign(round_)),
                _absent(keys.closed),
                _cmp(keys.closer(round_), CompareTarget.CREATE, claimed_at),
                _cmp(prefix, CompareTarget.MOD, read.revision + 1, op=CompareOp.LESS, prefix=True),
            ],
            [*ops, GetOp(keys.round(round_ + 1), prefix=True, keys_only=True)],
            [],
        )
        if not res.succeeded:
            return None
        following = {kv.key for kv in res.get(len(ops)).kvs}
        nxt = _next_round_view(keys, round_ + 1, following, closed=False)
        return _Outcome(assignment, nxt, res.revision, res.revision)

    # -- membership ----------------------------------------------------------------------------------
    def _become_member(self, outcome: _Outcome) -> None:
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
            refresher = _LeaseRefresher(self._client, assignment.lease, interval)
        self._member = _Membership(
            assignment=assignment,
            successor=watch,
            refresher=refresher,
            next_seen=outcome.revision,
            next_round=outcome.next_round or NextRoundView(closer=False, wake=False, assigned=False, closed=False),
        )
        if outcome.next_round is None:
            self._refresh_next_round(self._member)

    def _refresh_next_round(self, member: _Membership) -> None:
        keys, nxt = self._keys, member.round + 1
        res = self._txn([], [GetOp(keys.round(nxt), prefix=True, keys_only=True), GetOp(keys.closed, keys_only=True)])
        member.next_seen = res.revision
        member.next_round = _next_round_view(keys, nxt, {kv.key for kv in res.get(0).kvs}, bool(res.get(1).kvs))

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
        return bool(self._txn([], [GetOp(self._keys.closed, keys_only=True)]).get(0).kvs)

    def set_closed(self) -> None:
        self._txn([], [PutOp(self._keys.closed, b"1", lease=self.state_lease_id())])

    def shutdown(self) -> bool:
        try:
            if compat.shutdown_on_death_signal():
                # torch 2.6's agent closes the rendezvous when a signal stops it; torch's launcher and later
                # agents leave it open, so that the other nodes re-form without this one: do as they do.
                logger.info("stopped by a signal: leaving the rendezvous open for the other nodes")
                return True
            try:
                self.set_closed()
            except RendezvousConnectionError:
                logger.warning("could not close rendezvous %s", self._run_id, exc_info=True)
                return False
            return True
        finally:
            self.release()

    def release(self) -> None:
        """Stop the watches and revoke this node's lease (its keys vanish at once); idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            node, state, watch = self._node_lease, self._state_lease, self._rounds_watch
        member, self._member = self._member, None
        if member is not None:
            member.close()
        if watch is not None:
            SHARED_WATCHERS.release(self._client, self._keys.rounds, watch)
        if node is not None:
            node.close()
        if state is not None:
            state.close(revoke=False)  # rounds and store outlive one agent's clean exit

    # -- helpers -------------------------------------------------------------------------------------
    def _ensure_rounds_watch(self, start_revision: int) -> None:
        with self._lock:
            if self._rounds_watch is None:
                self._rounds_watch = SHARED_WATCHERS.acquire(self._client, self._keys.rounds, start_revision)
                atexit.register(self.release)

    def _decode(self, raw: bytes) -> Assignment:
        try:
            return Assignment.decode(raw)
        except ValueError as exc:
            raise RendezvousStateError(f"rendezvous {self._run_id}: {exc}") from exc

    def _txn(self, compare: list[Compare], success: list[TxnOp], failure: list[TxnOp] | None = None) -> TxnResult:
        return self._wrap(lambda: self._client.txn(compare, success, failure or []))

    def _wrap(self, fn: Any) -> Any:
        try:
            return fn()
        except EtcdError as exc:
            raise _translate(exc) from exc
