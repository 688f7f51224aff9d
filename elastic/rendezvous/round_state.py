"""The pieces the ``etcd-v3`` handler and its round closer share: what a round's wait yields, a member's
state, the round lease's refresher, and the etcd helpers (compares, error translation).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from elastic.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    EtcdClient,
    EtcdConnectionError,
    EtcdError,
    TxnOp,
    TxnResult,
)
from elastic.etcd.watch import RevisionWatcher
from elastic.rendezvous.protocol import Assignment, Head, NextRoundView, RendezvousKeys

logger = logging.getLogger(__name__)

__all__ = [
    "LeaseRefresher",
    "Membership",
    "Outcome",
    "absent",
    "compare",
    "decode_assignment",
    "next_round_view",
    "parse_head",
    "translate",
    "txn",
    "wrapped",
]

T = TypeVar("T")


@dataclass
class Membership:
    """This node's place in a completed round, and what it has seen of the next one."""

    assignment: Assignment
    successor: RevisionWatcher | None
    refresher: LeaseRefresher | None
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
class Outcome:
    """A round's assignment, and what was seen of the next round in the same read (None: not read)."""

    assignment: Assignment
    next_round: NextRoundView | None
    revision: int
    head_revision: int  # the revision that assigned the round (it wrote the head too)


def next_round_view(keys: RendezvousKeys, round_: int, present: set[str], closed: bool) -> NextRoundView:
    return NextRoundView(
        closer=keys.closer(round_) in present,
        wake=keys.wake(round_) in present,
        assigned=keys.assign(round_) in present,
        closed=closed,
    )


def compare(
    key: str, target: CompareTarget, value: int, *, op: CompareOp = CompareOp.EQUAL, prefix: bool = False
) -> Compare:
    return Compare(key, target, op, value, prefix=prefix)


def translate(exc: EtcdError) -> RendezvousConnectionError:
    if isinstance(exc, EtcdConnectionError):
        return RendezvousConnectionError(f"The connection to etcd has failed: {exc}")
    return RendezvousConnectionError(f"etcd rejected a rendezvous request: {exc}")


def absent(key: str) -> Compare:
    return compare(key, CompareTarget.CREATE, 0)


def parse_head(raw: bytes) -> Head:
    try:
        return Head.decode(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"the rendezvous in etcd is corrupt: {exc}") from exc


class LeaseRefresher:
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


def decode_assignment(run_id: str, raw: bytes) -> Assignment:
    try:
        return Assignment.decode(raw)
    except ValueError as exc:
        raise RendezvousStateError(f"rendezvous {run_id}: {exc}") from exc


def wrapped(fn: Callable[[], T]) -> T:
    """``fn()``, with etcd's failures raised as torch's ``RendezvousConnectionError``."""
    try:
        return fn()
    except EtcdError as exc:
        raise translate(exc) from exc


def txn(
    client: EtcdClient, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
) -> TxnResult:
    return wrapped(lambda: client.txn(compares, success, failure))
