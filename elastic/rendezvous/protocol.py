"""The ``etcd-v3`` rendezvous protocol: its etcd layout and its pure decisions (no I/O here).

Each joiner writes its own key; one participant per round, the *closer*, decides when the round is
complete and assigns every rank in one transaction fenced by revision; everyone else waits on a watch.
The etcd work per participant and round is a constant (see docs/rendezvous.md): no participant ever
rewrites a shared blob, so N joiners cause O(N) writes, not O(N²) conflicting compare-and-swaps.

Layout under ``<key_prefix>/<run_id>/`` (:class:`RendezvousKeys`):

``rdzv/alive/<node>``         one per live agent, on its short lease (``node_ttl``)
``rdzv/join/<r>/<node>``      a joiner of round ``r``, on its short lease
``rdzv/round/<r>/closer``     the closer of round ``r``, on its short lease (taken over if it dies)
``rdzv/round/<r>/assign``     round ``r``'s members in rank order (JSON), on the long state lease
``rdzv/round/<r>/wake``       someone asks round ``r - 1``'s members to re-form (a member left or died)
``rdzv/round/closed``         the rendezvous is closed (the job is over)
``rdzv/head``                 the newest assigned round and its size
``store/``                    the rounds' key-value store (torch's ``Store``)
``live/``                     the job's own group in live recovery (``--rdzv-conf recovery=live``), kept by
                              the workers (:mod:`elastic.live`), never by the rendezvous
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "CloseNow",
    "FormingView",
    "Head",
    "NextRoundView",
    "RendezvousKeys",
    "RoundAssignment",
    "RoundRules",
    "WaitUntil",
    "close_decision",
    "previous_round_full",
    "select_members",
    "waiting_reason",
]


@dataclass(frozen=True)
class RendezvousKeys:
    """Where one run's rendezvous lives in etcd (one home for the layout; see the module docstring)."""

    base: str  # "<key_prefix>/<run_id>/"

    @classmethod
    def of(cls, key_prefix: str, run_id: str) -> RendezvousKeys:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if "/" in run_id:
            raise ValueError(f"The run id must not contain '/': {run_id!r}")
        return cls(f"{key_prefix.rstrip('/')}/{run_id}/")

    @property
    def rdzv(self) -> str:
        return self.base + "rdzv/"

    @property
    def store(self) -> str:
        return self.base + "store"

    @property
    def live(self) -> str:
        """The live group's prefix (``ETRAIN_LIVE_PREFIX`` of the workers in live recovery)."""
        return self.base + "live/"

    @property
    def alive(self) -> str:
        return self.rdzv + "alive/"

    @property
    def head(self) -> str:
        return self.rdzv + "head"

    @property
    def rounds(self) -> str:
        return self.rdzv + "round/"

    @property
    def closed(self) -> str:
        return self.rounds + "closed"

    def alive_key(self, node: str) -> str:
        return self.alive + node

    def joins(self, round_: int) -> str:
        return f"{self.rdzv}join/{round_}/"

    def join_key(self, round_: int, node: str) -> str:
        return self.joins(round_) + node

    def round(self, round_: int) -> str:
        return f"{self.rounds}{round_}/"

    def closer(self, round_: int) -> str:
        return self.round(round_) + "closer"

    def assign(self, round_: int) -> str:
        return self.round(round_) + "assign"

    def wake(self, round_: int) -> str:
        return self.round(round_) + "wake"


@dataclass(frozen=True)
class RoundRules:
    """torch's rendezvous semantics: complete at ``max_nodes`` at once, or ``last_call`` after the latest
    join once ``min_nodes`` are in. A re-formed round (``round > 0``) that holds every live agent of the
    run completes at once: the agents it would wait for are known not to exist."""

    min_nodes: int
    max_nodes: int
    last_call: timedelta

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be at least 1, not {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes ({self.max_nodes}) must be at least min_nodes ({self.min_nodes})")


@dataclass(frozen=True)
class FormingView:
    """What the closer knows of a forming round: ``joined`` keys, ``alive`` agents of the run, and when
    (monotonic seconds) the join count last grew while at or above ``min_nodes`` (None: not yet)."""

    round: int
    joined: int
    alive: int
    last_growth: float | None
    #: the previous round runs full with all its members: the joiners are spares (torch's redundancy list)
    #: and wait until a member leaves or dies, however many they are
    previous_full: bool = False


@dataclass(frozen=True)
class CloseNow:
    reason: str


@dataclass(frozen=True)
class WaitUntil:
    """Nothing to do before ``deadline`` (monotonic seconds) unless the view changes; None: no deadline."""

    deadline: float | None


def close_decision(view: FormingView, now: float, rules: RoundRules) -> CloseNow | WaitUntil:
    """Whether the closer completes the round now."""
    if view.previous_full:
        return WaitUntil(None)
    if view.joined >= rules.max_nodes:
        return CloseNow(f"{view.joined} joined, max_nodes={rules.max_nodes}")
    if view.joined < rules.min_nodes:
        return WaitUntil(None)
    if view.round > 0 and view.alive <= view.joined:
        return CloseNow(f"all {view.alive} live agents of the run joined the re-formed round")
    growth = view.last_growth if view.last_growth is not None else now
    deadline = growth + rules.last_call.total_seconds()
    if now >= deadline:
        return CloseNow(f"{view.joined} joined, last call of {rules.last_call.total_seconds():g}s passed")
    return WaitUntil(deadline)


def previous_round_full(head: Head | None, round_: int, previous_joined: int, rules: RoundRules) -> bool:
    """Whether round ``round_ - 1`` is the newest, has ``max_nodes`` members and none has left it (a member
    that leaves or dies takes its join key with it)."""
    if head is None or head.round != round_ - 1:
        return False
    return head.size >= rules.max_nodes and previous_joined >= head.size


def select_members(joins: Sequence[tuple[str, int]], max_nodes: int) -> tuple[str, ...]:
    """The round's members in rank order from ``(node, create_revision)`` join keys: the first
    ``max_nodes`` to join, ranked by node id (stable for the same set of nodes)."""
    first = sorted(joins, key=lambda j: (j[1], j[0]))[:max_nodes]
    return tuple(sorted(node for node, _ in first))


@dataclass(frozen=True)
class RoundAssignment:
    """A completed round: ``members`` in rank order; ``fence``: the revision the closer read the joins at
    (a member that vanished after it is watched for from the next revision)."""

    round: int
    members: tuple[str, ...]
    fence: int
    lease: int = 0  # the lease the round's keys hang on: every member keeps it alive

    def encode(self) -> bytes:
        data = {"round": self.round, "members": list(self.members), "fence": self.fence, "lease": self.lease}
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> RoundAssignment:
        try:
            data = json.loads(raw)
            members = tuple(str(m) for m in data["members"])
            lease = int(data.get("lease", 0))
            return cls(round=int(data["round"]), members=members, fence=int(data["fence"]), lease=lease)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed rendezvous assignment: {raw[:80]!r}") from exc

    def rank(self, node: str) -> int | None:
        try:
            return self.members.index(node)
        except ValueError:
            return None

    def successor(self, node: str) -> str | None:
        """The member this node watches: the next one in rank order, wrapping (None when alone).

        Every member watches one other, so that each loss is seen by exactly one survivor (the first
        survivor before a run of dead members), who asks all to re-form: O(1) watch events per member.
        """
        rank = self.rank(node)
        if rank is None or len(self.members) < 2:
            return None
        return self.members[(rank + 1) % len(self.members)]


@dataclass(frozen=True)
class Head:
    """The newest assigned round and its size (the ``head`` key: ``"<round> <size>"``)."""

    round: int
    size: int

    def encode(self) -> bytes:
        return f"{self.round} {self.size}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Head:
        try:
            round_, size = raw.split()
            return cls(int(round_), int(size))
        except ValueError as exc:
            raise ValueError(f"malformed rendezvous head: {raw[:40]!r}") from exc


@dataclass(frozen=True)
class NextRoundView:
    """What a member of round ``r`` sees of round ``r + 1``."""

    closer: bool  # someone is waiting to form it
    wake: bool  # a member of round r asked to re-form
    assigned: bool  # it formed without this node
    closed: bool  # the rendezvous is closed


def waiting_reason(members: int, max_nodes: int, nxt: NextRoundView, successor_lost: bool) -> str | None:
    """Why the members of a running round should re-form (torchrun's ``num_nodes_waiting() > 0``), or None.

    A node waiting for the next round counts only while the round has room for it (torch's rule: a full
    round keeps running and the node stays a spare); a member that left or died always counts.
    """
    if nxt.closed:
        return None
    if successor_lost:
        return "a member of this round lost its lease"
    if nxt.assigned:
        return "the next round formed without this node"
    if nxt.wake:
        return "a member of this round left it"
    if nxt.closer and members < max_nodes:
        return f"a node waits to join ({members} of max {max_nodes} members)"
    return None
