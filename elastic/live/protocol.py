"""Live recovery's membership protocol: its etcd layout and its pure decisions (no I/O here).

A job's workers form their own process group in live mode: each worker registers under its own lease; the
members of each *generation* of the group are one key, replaced only by a transaction fenced on its
revision, so two proposals never both win. A generation ends when a member fails (the survivors ask for
the next one and the first of them commits it once every live member asked, or a short settle time passed)
or at a step boundary where the members admit workers that registered since (a joiner, a restarted worker).
A generation whose members are all gone is re-*founded* from the registered workers, who then restore the
newest snapshot from storage: the restart path, reached without any process restart of its own.

Layout under the job's live prefix (``<key_prefix>/<run_id>/live/``, see :class:`LiveKeys`):

``m/workers/<id>``    one per live worker, on its own lease (:class:`WorkerRecord`)
``m/join/<id>``       a worker that waits to be admitted (new, restarted, or too late for a re-form), on its
                      lease; a member that died is never a joiner, even while its lease lasts
``m/gen``             the current generation: its number and members in rank order (:class:`Generation`)
``m/ready/<g>/<id>``  a member of generation ``g - 1`` asks to re-form into generation ``g``, on its lease
``store/<g>/``        generation ``g``'s process-group store (torch's ``Store``)
``m/done``            the job finished: a worker that comes later has nothing to join
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

__all__ = [
    "CommitNow",
    "Generation",
    "LiveKeys",
    "LiveOptions",
    "LiveProtocolError",
    "MemberState",
    "ReformReason",
    "StepAttempt",
    "SyncPlan",
    "WaitUntil",
    "WorkerRecord",
    "found_decision",
    "next_members",
    "reform_decision",
    "sync_plan",
    "whole_groups",
]


class LiveProtocolError(ValueError):
    """A value under the live prefix that is not what this protocol writes (a foreign or corrupt key)."""


@dataclass(frozen=True)
class LiveKeys:
    """Where one job's live group lives in etcd (one home for the layout; see the module docstring)."""

    base: str  # ends with "/"

    def __post_init__(self) -> None:
        if not self.base.endswith("/"):
            raise ValueError(f"a live prefix must end with '/': {self.base!r}")

    @property
    def membership(self) -> str:
        """Every membership key (what a member watches; the stores' traffic is outside it)."""
        return self.base + "m/"

    @property
    def workers(self) -> str:
        return self.membership + "workers/"

    def worker(self, wid: str) -> str:
        return self.workers + wid

    @property
    def joiners(self) -> str:
        return self.membership + "join/"

    def joiner(self, wid: str) -> str:
        return self.joiners + wid

    @property
    def gen(self) -> str:
        return self.membership + "gen"

    def ready(self, gen: int) -> str:
        return f"{self.membership}ready/{gen}/"

    def ready_key(self, gen: int, wid: str) -> str:
        return self.ready(gen) + wid

    @property
    def done(self) -> str:
        return self.membership + "done"

    @property
    def store(self) -> str:
        return self.base + "store/"

    def gen_store(self, gen: int) -> str:
        return f"{self.store}{gen}/"


@dataclass(frozen=True)
class LiveOptions:
    """Timings of live recovery (``ElasticConfig(live=)``, with ``recovery="live"``): the one home of their
    defaults (:class:`elastic.live.membership.LiveSettings` takes them from here)."""

    # each worker's lease in etcd: a worker that vanished without closing its connections counts as gone
    # after this long (a SIGKILL closes them: the survivors notice at once)
    ttl: timedelta = timedelta(seconds=3)
    # after a failure, how long the survivors wait for a member that looks alive but has not asked to re-form
    settle: timedelta = timedelta(seconds=0.25)
    # at the job's start: once min workers registered, how long to wait for more before founding the group
    last_call: timedelta = timedelta(seconds=1)
    # a worker stuck in a step while a member's lease is gone for this long aborts (NCCL) or falls back to a
    # restart (gloo); None: the ttl plus 2 s
    stuck_grace: timedelta | None = None
    join_timeout: timedelta = timedelta(minutes=10)
    reform_timeout: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        if self.ttl < timedelta(seconds=1):
            raise ValueError(f"live ttl must be at least 1 s, got {self.ttl}")
        for name in ("settle", "last_call", "join_timeout", "reform_timeout"):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"live {name} must be >= 0")


class ReformReason(str, Enum):
    FOUNDED = "founded"  # no live generation: the registered workers start one (state from storage)
    FAILURE = "failure"  # a member failed: the survivors re-form
    ADMIT = "admit"  # at a step boundary the members admit the workers that registered


@dataclass(frozen=True)
class WorkerRecord:
    wid: str
    host: str
    pid: int
    node: str

    def to_json(self) -> bytes:
        return json.dumps({"wid": self.wid, "host": self.host, "pid": self.pid, "node": self.node}).encode()


@dataclass(frozen=True)
class Generation:
    """One generation of the live group: its number, its members in rank order, and why it formed."""

    number: int
    members: tuple[str, ...]
    reason: ReformReason

    def rank(self, wid: str) -> int | None:
        try:
            return self.members.index(wid)
        except ValueError:
            return None

    def to_json(self) -> bytes:
        return json.dumps({"number": self.number, "members": list(self.members), "reason": self.reason.value}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Generation:
        try:
            data = json.loads(raw)
            members = data["members"]
            if not isinstance(members, list) or not all(isinstance(m, str) for m in members) or not members:
                raise ValueError("members must be a non-empty list of worker ids")
            number = data["number"]
            if type(number) is not int or number < 1:
                raise ValueError("number must be a whole number >= 1")
            return cls(number, tuple(members), ReformReason(data["reason"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise LiveProtocolError(f"not a live generation: {exc}") from None


def whole_groups(count: int, granularity: int, at_least: int = 0) -> int:
    """The most workers of ``count`` that form whole groups of ``granularity`` (a sharded model's replicas), not
    fewer than ``at_least`` (members are never dropped to round down: the trainer then falls back)."""
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    return max(count - count % granularity, min(at_least, count))


def next_members(
    current: Generation, ready: Iterable[str], joining: Iterable[str], max_workers: int, granularity: int = 1
) -> tuple[str, ...]:
    """The next generation's members: the ready members of ``current`` in their rank order, then the
    joiners that are not members in id order, at most ``max_workers`` in all; with ``granularity`` > 1 (a
    sharded model's replica size) joiners are admitted only in numbers that keep the world a multiple of it."""
    ready_set = set(ready)
    survivors = [m for m in current.members if m in ready_set]
    old = set(current.members)
    joiners = sorted(w for w in set(joining) if w not in old)
    members = [*survivors, *joiners][:max_workers]
    return tuple(members[: whole_groups(len(members), granularity, at_least=len(survivors))])


@dataclass(frozen=True)
class CommitNow:
    members: tuple[str, ...]


@dataclass(frozen=True)
class WaitUntil:
    """Nothing to commit yet; look again when something changes, at the latest ``after`` from now."""

    after: timedelta


def reform_decision(
    current: Generation,
    ready: Iterable[str],
    alive: Iterable[str],
    since_first_ready: timedelta,
    settle: timedelta,
    max_workers: int,
    joining: Iterable[str] = (),
    min_workers: int = 1,
    granularity: int = 1,
) -> CommitNow | WaitUntil:
    """Whether the ready members of ``current`` may commit the next generation now (with the ``joining``
    workers admitted).

    Every member still alive (its worker key exists) is ready: commit. Otherwise a member that looks alive
    may be dead (its lease not expired yet after a SIGKILL) or slow: commit once ``settle`` passed since the
    first member asked; one that asks later joins the generation after. Fewer than ``min_workers``: wait
    for joiners (the caller gives up after its timeout and falls back to the restart path)."""
    ready_set, alive_set = set(ready), set(alive)
    members = next_members(current, ready_set, joining, max_workers, granularity)
    if not any(m in ready_set for m in current.members):
        return WaitUntil(settle)
    waiting_for = [m for m in current.members if m in alive_set and m not in ready_set]
    if waiting_for and since_first_ready < settle:
        return WaitUntil(settle - since_first_ready)
    if len(members) < min_workers:  # a quorum below min_nodes: hold the state and wait for joiners
        return WaitUntil(settle)
    return CommitNow(members)


def found_decision(
    registered: Sequence[str],
    min_workers: int,
    max_workers: int,
    since_min_reached: timedelta | None,
    last_call: timedelta,
    granularity: int = 1,
) -> CommitNow | WaitUntil | None:
    """Whether the registered workers (no live generation) found one now: ``max_workers`` registered, or at
    least ``min_workers`` for ``last_call`` (latecomers of a start join in one go). None: too few. With
    ``granularity`` > 1 only whole groups of it found (the rest join later, as joiners)."""
    workers = sorted(registered)
    workers = workers[: whole_groups(min(len(workers), max_workers), granularity)]
    if len(workers) >= max_workers:
        return CommitNow(tuple(workers[:max_workers]))
    if len(workers) < min_workers or since_min_reached is None:
        return None
    if since_min_reached >= last_call:
        return CommitNow(tuple(workers))
    return WaitUntil(last_call - since_min_reached)


@dataclass(frozen=True)
class StepAttempt:
    """A step a member worked on and had not recorded as committed when its generation ended."""

    step: int  # the step number it would commit (committed step + 1 before it was applied)
    rank: int  # the member's rank in the generation it ran in
    world_size: int
    applied: bool  # its optimizer step ran (the gradient all-reduce completed here)


@dataclass(frozen=True)
class MemberState:
    """What each member of a new generation tells the others before they continue (all-gathered)."""

    wid: str
    step: int  # the newest step applied to this member's state; -1: a joiner without state
    attempt: StepAttempt | None = None
    recorded: int = 0  # the newest step this member recorded as committed (its step hook ran)
    recorded_rank: int | None = None  # its rank in the generation that ran step ``recorded`` (None: not known)


@dataclass(frozen=True)
class SyncPlan:
    """How a new generation continues: whose state everyone takes, and which steps commit late."""

    source: int  # the rank whose state every other member receives
    step: int  # the step everyone continues from
    broadcast: bool  # some member's state differs from the source's (a joiner, or a member a step behind)
    late: tuple[int, ...] = field(default=())  # ranks that record their attempt of ``step`` now
    orphans: tuple[int, ...] = field(default=())  # old ranks of ``step``'s attempt that no survivor records

    def records_late(self, rank: int) -> bool:
        return rank in self.late


def sync_plan(states: Sequence[MemberState]) -> SyncPlan:
    """Decide from every member's :class:`MemberState` (in new rank order).

    The step to continue from is the newest one any member applied: a member applies a step only after its
    gradient all-reduce completed, and a completed all-reduce holds every old rank's contribution, so that
    step consumed every old rank's samples even if some member failed before applying it. Members behind it
    receive the source's state; members whose attempt is that step and who did not record it record it now
    (late), and the old ranks no survivor covers (the dead) are recorded by the new rank 0 (``orphans``)."""
    if not states:
        raise ValueError("a generation has members")
    step = max(s.step for s in states)
    if step < 0:
        raise ValueError("no member holds training state: a generation without state must be founded")
    source = next(i for i, s in enumerate(states) if s.step == step)
    broadcast = any(s.step != step for s in states)
    late: list[int] = []
    covered: set[int] = set()
    world = None
    for i, s in enumerate(states):
        if s.recorded >= step and s.recorded_rank is not None:
            covered.add(s.recorded_rank)  # it recorded the step already, though its attempt may be the next one
        a = s.attempt
        if a is None or a.step != step:
            continue
        world = a.world_size
        if s.recorded >= step:
            covered.add(a.rank)
        else:
            late.append(i)
            covered.add(a.rank)
    orphans: tuple[int, ...] = ()
    if late and world is not None:  # the step commits now: record the old ranks no survivor covers
        orphans = tuple(r for r in range(world) if r not in covered)
    return SyncPlan(source, step, broadcast, tuple(late), orphans)
