"""When the ranks agree on a step boundary's flags (:class:`~elastic.train.boundary.BoundaryFlags`): at every
boundary, or every few boundaries overlapped with the next step. One object per mode, chosen by the strategy
(:meth:`~elastic.train.strategy.ParallelStrategy.agreement`).

- :class:`ImmediateAgreement` (live recovery, sharded models, a world of one): the all-reduce runs at each boundary
  and its flags are acted on there. Live recovery needs it: the agreement is the step's commit point, and a lost
  peer must be caught at the step it broke.
- :class:`DeferredAgreement` (restart mode with DDP, and the framework adapters): the all-reduce is started at a
  boundary, after its snapshots, and waited for at the next one, where its flags are acted on; and it is started
  only every few boundaries. Each agreement is one more collective in which every rank wakes up for the others: on
  busy cores that cost 2-10 % of a 30 ms step (``bench/loop_overhead_bench.py --loader``, docs/benchmarks.md), while
  DDP's gradient all-reduce already meets every rank once per step. How many steps one agreement covers follows
  the group's slowest step: as many as fit in ``interval`` (250 ms by default), at most :data:`MAX_WINDOW`, one
  when a step is slower than that. Every rank computes it from the same agreed figure, so every rank issues the
  same collectives.

  What is decided later than the boundary it arises at (by up to ``interval`` plus one step): a time-based
  snapshot, a SIGTERM (everyone saves then; the stop timeout allows at least three of the slowest steps), and a
  step whose optimizer(s) ran on some ranks only (each agreement carries every step's count of its window, so
  :class:`~elastic.train.step.StepMismatchError` still names the step). What is not: a boundary where a snapshot
  may be due on a schedule every rank knows (a multiple of ``save_every_steps``, a pending snapshot, a node-local
  snapshot's earliest step) has its flags agreed: the caller says so (``soon`` to :meth:`~BoundaryAgreement.launch`
  the boundary before, ``needed`` to :meth:`~BoundaryAgreement.agreed`, which then agrees at once when nothing is
  in flight, e.g. at an epoch's end). A boundary with no flags agreed (:meth:`~BoundaryAgreement.agreed` returns
  None) takes no snapshot. The window still open when the steps end is agreed then (:meth:`drain`).

The contract, per boundary: :meth:`BoundaryAgreement.agreed` (the flags to act on now, a collective, a wait or
None), the boundary's actions, then :meth:`~BoundaryAgreement.launch` (nothing, or the next agreement started);
:meth:`~BoundaryAgreement.drain` once the steps end (every rank: it may agree); :meth:`~BoundaryAgreement.discard`
when the group is gone. Every decision to issue a collective is a function of what every rank shares.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from elastic.train.boundary import BoundaryFlags
from elastic.train.step import StepMismatchError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_INTERVAL",
    "MAX_WINDOW",
    "Agreed",
    "BoundaryAgreement",
    "DeferredAgreement",
    "ImmediateAgreement",
    "check_steps",
    "checked_flags",
    "replicas_agreement",
]

#: this rank's view of a boundary, asked for the boundary it is acted on (computed when the agreement is made or
#: started: a deferred one's is the next boundary)
LocalFlags = Callable[[int], BoundaryFlags]

#: the most loop steps one deferred agreement covers (its all-reduce carries each one's optimizer step counts)
MAX_WINDOW = 16
#: how long a deferred agreement's window may last, in the group's slowest step times
DEFAULT_INTERVAL = timedelta(milliseconds=250)


@dataclass(frozen=True)
class Agreed:
    """The group's flags of the boundary that ended ``step``, and how many optimizer steps this rank ran in it
    (for an agreement covering several steps: the first step whose counts differ between ranks, else the last)."""

    step: int
    flags: BoundaryFlags
    stepped_here: int


def check_steps(agreed: Agreed) -> None:
    """Raise :class:`StepMismatchError` when the optimizer(s) of ``agreed.step`` ran on some ranks only."""
    flags = agreed.flags
    if flags.steps_agree:
        return
    raise StepMismatchError(
        f"step {agreed.step}: the optimizer(s) stepped {-flags.optimizer_steps_neg} time(s) on some ranks and "
        f"{flags.optimizer_steps} on others (this rank: {agreed.stepped_here}); a step skipped on some ranks only "
        "leaves the replicas apart: decide a skip on values every rank shares (the all-reduced gradients, as "
        "GradScaler does), never on a rank's own loss"
    )


def checked_flags(agreed: Agreed | None) -> BoundaryFlags | None:
    """The flags to act on (None: none were agreed at this boundary), once :func:`check_steps` passed."""
    if agreed is None:
        return None
    check_steps(agreed)
    return agreed.flags


class BoundaryAgreement(ABC):
    """See the module docstring. ``device`` and ``group``: where the all-reduce runs (the loop's host collectives;
    ``group`` is called for each agreement, as the group may change)."""

    #: how many boundaries after the one it is started at an agreement is acted on (a node-local snapshot's flag is
    #: asked for the step it would be taken at)
    lag: ClassVar[int]

    def __init__(self, device: torch.device, group: Callable[[], Any]) -> None:
        self._device = device
        self._group = group

    @abstractmethod
    def agreed(self, step: int, stepped: int, local: LocalFlags, *, needed: bool) -> Agreed | None:
        """The flags to act on at the boundary ending ``step`` (this rank ran ``stepped`` optimizer steps in it):
        this boundary's or an earlier one's; None when none are agreed here. ``needed``: a snapshot may be due
        here on a schedule every rank knows, so flags must be agreed. Raises what a failed collective raises."""

    def launch(self, step: int, local: LocalFlags, *, soon: bool) -> None:
        """After the boundary's actions: start the agreement acted on at the next one, when it is due (``soon``:
        the next boundary needs flags, see :meth:`agreed`). Nothing by default."""
        return None

    def drain(self, mine: BoundaryFlags | None = None) -> Agreed | None:
        """The steps ended: the agreement still in flight waited for, and the steps not yet agreed on agreed, with
        this rank's view ``mine`` at the end (every rank calls it); None when there were none."""
        return None

    def discard(self) -> None:
        """The group is going away: forget what is in flight (without waiting for it)."""
        return None


class ImmediateAgreement(BoundaryAgreement):
    """One all-reduce at each boundary, acted on there."""

    lag = 0

    def agreed(self, step: int, stepped: int, local: LocalFlags, *, needed: bool) -> Agreed:
        return Agreed(step, local(step).agree(self._device, self._group()), stepped)


class DeferredAgreement(BoundaryAgreement):
    """An all-reduce every few boundaries, started after one boundary's actions and acted on at the next (see the
    module docstring). ``interval``: how long one agreement's window may last, in the group's slowest steps."""

    lag = 1

    def __init__(self, device: torch.device, group: Callable[[], Any], interval: timedelta = DEFAULT_INTERVAL) -> None:
        super().__init__(device, group)
        if interval < timedelta(0):
            raise ValueError(f"the agreement interval must be >= 0, got {interval}")
        self._interval = interval.total_seconds()
        self._pending: _Pending | None = None
        self._window = _Window()
        self._last_boundary: float | None = None  # time.monotonic() at the last boundary (a step's end)
        self._every = 1  # boundaries per agreement: from the group's slowest step, the same on every rank

    @property
    def interval(self) -> timedelta:
        """How long one agreement's window may last (in the group's slowest steps)."""
        return timedelta(seconds=self._interval)

    @property
    def every(self) -> int:
        """How many boundaries the next agreement covers (1 until the group's step time is known)."""
        return self._every

    def agreed(self, step: int, stepped: int, local: LocalFlags, *, needed: bool) -> Agreed | None:
        now = time.monotonic()
        took = None if self._last_boundary is None else now - self._last_boundary
        self._last_boundary = now
        self._window.add(step, stepped, took)
        if self._pending is not None:
            return self._wait()
        if needed:  # e.g. an epoch's end: agreed now, as an immediate agreement would
            return self._collect(self._start(step, local(step), async_op=False))
        return None

    def launch(self, step: int, local: LocalFlags, *, soon: bool) -> None:
        if self._pending is not None:
            raise RuntimeError(f"step {step}: the agreement of step {self._pending.started_at} was never waited for")
        if soon or len(self._window.counts) >= self._every:
            self._pending = self._start(step, local(step + self.lag), async_op=True)

    def drain(self, mine: BoundaryFlags | None = None) -> Agreed | None:
        waited = self._wait() if self._pending is not None else None
        if self._window.counts and (waited is None or waited.flags.steps_agree):
            view = mine or BoundaryFlags()
            if waited is not None:  # what the group agreed already is kept (a MAX of the views)
                view = BoundaryFlags.decode(
                    [max(a, b) for a, b in zip(view.encode(), waited.flags.encode(), strict=True)]
                )
            return self._collect(self._start(self._window.last, view, async_op=False))
        self._window = _Window()
        return waited

    def discard(self) -> None:
        if self._pending is not None:
            logger.debug("the agreement started at step %d is dropped unread", self._pending.started_at)
        self._pending = None
        self._window = _Window()

    def _start(self, step: int, mine: BoundaryFlags, *, async_op: bool) -> _Pending:
        """Start (or, not ``async_op``, make) the agreement of the window, at the boundary ending ``step``."""
        window, self._window = self._window, _Window()
        counts = window.counts
        values = [*mine.encode(), int(window.slowest * 1e6), *_padded(counts), *_padded([-n for n in counts])]
        tensor = torch.tensor(values, device=self._device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group(), async_op=async_op)
        return _Pending(step, window.first, tuple(counts), tensor, work)

    def _wait(self) -> Agreed:
        pending, self._pending = self._pending, None
        assert pending is not None
        pending.work.wait()
        return self._collect(pending)

    def _collect(self, pending: _Pending) -> Agreed:
        """The group's flags, the next window's length (from the group's slowest step), and the window's first step
        whose optimizer step counts differ between ranks (else its last)."""
        values = [int(v) for v in pending.tensor.tolist()]
        n = len(values) - 1 - 2 * MAX_WINDOW
        flags = BoundaryFlags.decode(values[:n])
        most, neg_fewest = values[n + 1 : n + 1 + MAX_WINDOW], values[n + 1 + MAX_WINDOW :]
        self._every = _window_for(self._interval, values[n])
        counts = pending.counts
        if not counts:  # the window was empty (started right after a synchronous agreement)
            return Agreed(pending.started_at, replace(flags, optimizer_steps=0, optimizer_steps_neg=0), 0)
        at = next((i for i in range(len(counts)) if most[i] != -neg_fewest[i]), len(counts) - 1)
        flags = replace(flags, optimizer_steps=most[at], optimizer_steps_neg=neg_fewest[at])
        return Agreed(pending.first + at, flags, counts[at])


def replicas_agreement(
    world_size: int, device: torch.device, group: Callable[[], Any], interval: timedelta = DEFAULT_INTERVAL
) -> BoundaryAgreement:
    """The agreement of replicas whose gradient all-reduce meets every rank once per step (DDP, in restart mode: the
    loop's, or a framework's): deferred, but for a world of one (nothing to agree on)."""
    if world_size == 1:
        return ImmediateAgreement(device, group)
    return DeferredAgreement(device, group, interval)


def _window_for(interval_s: float, slowest_us: int) -> int:
    """Boundaries per agreement for the group's slowest step (µs; 0: not measured yet)."""
    if slowest_us <= 0:
        return 1
    return max(1, min(MAX_WINDOW, int(interval_s * 1e6 // slowest_us)))


def _padded(values: Sequence[int]) -> list[int]:
    if len(values) > MAX_WINDOW:
        raise RuntimeError(f"{len(values)} steps since the last agreement, at most {MAX_WINDOW} expected")
    return list(values) + [0] * (MAX_WINDOW - len(values))


@dataclass
class _Window:
    """The boundaries since the last agreement was started: this rank's optimizer steps in each (from step
    ``first``), and the slowest of their steps (seconds between boundaries; the first step is not timed)."""

    first: int = 0
    counts: list[int] = field(default_factory=list)
    slowest: float = 0.0

    @property
    def last(self) -> int:
        return self.first + len(self.counts) - 1

    def add(self, step: int, stepped: int, took: float | None) -> None:
        if not self.counts:
            self.first = step
        self.counts.append(stepped)
        if took is not None:
            self.slowest = max(self.slowest, took)


@dataclass(frozen=True)
class _Pending:
    started_at: int  # the boundary it was started at
    first: int  # its window's first step
    counts: tuple[int, ...]  # this rank's optimizer steps of each step of its window
    tensor: torch.Tensor
    work: Any  # the all-reduce's c10d Work (None: a synchronous one, done)
