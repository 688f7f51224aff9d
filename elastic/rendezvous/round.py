"""A completed round as a node of the ``etcd-v3`` rendezvous sees it: the round's :class:`Outcome` (its
assignment and what the same read saw of the next round) and this node's :class:`Membership` in it."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.etcd.watch import RevisionWatcher
from elastic.rendezvous.etcd_calls import LeaseRefresher
from elastic.rendezvous.protocol import NextRoundView, RendezvousKeys, RoundAssignment

__all__ = ["Membership", "Outcome", "next_round_view"]


@dataclass
class Membership:
    """This node's place in a completed round, and what it has seen of the next one."""

    assignment: RoundAssignment
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

    assignment: RoundAssignment
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
