"""The closer of a round: the one participant that decides when the round is complete and assigns every
rank, in one transaction fenced by revision (see docs/rendezvous.md).

It wakes on any change of the run's rendezvous keys (joins, liveness), at most every ``min_wake_interval``,
reads the counts it needs in one transaction, asks :func:`protocol.close_decision`, and commits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from elastic.etcd import CompareOp, CompareTarget, DeleteOp, EtcdClient, GetOp, PutOp, TxnOp
from elastic.etcd.watch import RevisionWatcher
from elastic.rendezvous.etcd_calls import absent, compare, decode_assignment, parse_head, txn
from elastic.rendezvous.protocol import (
    CloseNow,
    FormingView,
    Head,
    RendezvousKeys,
    RoundAssignment,
    RoundRules,
    close_decision,
    previous_round_full,
    select_members,
)
from elastic.rendezvous.round import Outcome, next_round_view

logger = logging.getLogger(__name__)

__all__ = ["RoundCloser"]

#: The longest the closer goes without reading the counts, should a watch event be missed.
SAFETY_POLL = 5.0


class RoundCloser:
    """Closes rounds of one run for one node (its ``state_lease`` holds the assignment and the head)."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        keys: RendezvousKeys,
        rules: RoundRules,
        *,
        min_wake_interval: timedelta,
        state_lease: Callable[[], int],
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._keys = keys
        self._rules = rules
        self._min_wake = min_wake_interval.total_seconds()
        self._state_lease = state_lease

    def close(self, round_: int, claimed_at: int, deadline: float | None) -> Outcome | None:
        """Complete ``round_``, claimed by this node at revision ``claimed_at``: its outcome, or None if
        another node took the closer's key over (or ``deadline`` passed first). Raises
        ``RendezvousClosedError`` if the rendezvous was closed meanwhile."""
        keys = self._keys
        watcher = RevisionWatcher(self._client, keys.rdzv, claimed_at + 1)
        try:
            last_joined, last_growth, last_wake, was_full = 0, None, 0.0, False
            while True:
                res = txn(
                    self._client,
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
                joins, alive_keys, assign, closer_key, closed, head_key, previous_joins = res.reads()
                if closed.kvs:
                    raise RendezvousClosedError()
                if assign.kvs:
                    kv = assign.kvs[0]
                    return Outcome(decode_assignment(self._run_id, kv.value), None, res.revision, kv.mod_revision)
                closer = closer_key.kvs
                if not closer or closer[0].create_revision != claimed_at:
                    return None  # this node's lease lapsed and another took over
                joined, alive = joins.count, alive_keys.count
                head = parse_head(head_key.kvs[0].value) if head_key.kvs else None
                full = previous_round_full(head, round_, previous_joins.count, self._rules)
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
                wait = SAFETY_POLL if deadline is None else min(deadline - now, SAFETY_POLL)
                if decision.deadline is not None:
                    wait = min(wait, max(decision.deadline - now, 0.0))
                spacing = last_wake + self._min_wake - time.monotonic()
                if spacing > 0:
                    time.sleep(spacing)  # with many joining, batch their joins into one read
                watcher.wait_beyond(res.revision, timedelta(seconds=wait))
                last_wake = time.monotonic()
        finally:
            watcher.close()

    def _commit(self, round_: int, claimed_at: int) -> Outcome | None:
        """Assign ranks to the round's joiners in one transaction, fenced: it applies only if no join came
        after the read, this node still holds the closer's key and the round is not assigned."""
        keys = self._keys
        read = txn(self._client, [], [GetOp(keys.joins(round_), prefix=True)])
        prefix = keys.joins(round_)
        joins = [(kv.key[len(prefix) :], kv.create_revision) for kv in read.get(0).kvs]
        members = select_members(joins, self._rules.max_nodes)
        if len(members) < self._rules.min_nodes:
            return None
        state = self._state_lease()
        assignment = RoundAssignment(round_, members, fence=read.revision, lease=state)
        ops: list[TxnOp] = [
            PutOp(keys.assign(round_), assignment.encode(), lease=state),
            PutOp(keys.head, Head(round_, len(members)).encode(), lease=state),
        ]
        if round_ >= 2:  # two rounds back nobody is left: drop them
            ops += [DeleteOp(keys.round(round_ - 2), prefix=True), DeleteOp(keys.joins(round_ - 2), prefix=True)]
        res = txn(
            self._client,
            [
                absent(keys.assign(round_)),
                absent(keys.closed),
                compare(keys.closer(round_), CompareTarget.CREATE, claimed_at),
                compare(prefix, CompareTarget.MOD, read.revision + 1, op=CompareOp.LESS, prefix=True),
            ],
            [*ops, GetOp(keys.round(round_ + 1), prefix=True, keys_only=True)],
            [],
        )
        if not res.succeeded:
            return None
        [next_round] = res.reads()  # the one read, after the writes
        following = {kv.key for kv in next_round.kvs}
        nxt = next_round_view(keys, round_ + 1, following, closed=False)
        return Outcome(assignment, nxt, res.revision, res.revision)
