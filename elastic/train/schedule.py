"""When the elastic loop takes a durable snapshot: a pure schedule (inputs -> decision; no clock, no I/O).

Snapshots fall due at every multiple of ``every_steps``, at each epoch end, and ``every`` (a duration) after
the last one was taken or fell due. What happens when one falls due while the previous one is still being
written (the writer busy on any rank) is ``when_busy``:

- ``defer`` (the default): the loop does not wait. The snapshot becomes *pending* and is taken at the first
  step boundary at which the writer is free, so it holds the newest state then. The step schedule keeps its
  fixed multiples of ``every_steps`` (it does not count from the deferred snapshot): a snapshot that falls
  due while one is pending is merged into it and counted as *skipped*. So every snapshot that falls due is
  either taken or skipped, and the storage sets the pace: one snapshot per save's duration.
- ``wait``: the snapshot is taken at once and the manager's save waits for the previous one (the loop
  stalls for it; what the loop did before deferral existed).

Contract (the loop, :mod:`elastic.train.trainer`, does the side effects):

- At each step boundary every rank calls :meth:`SnapshotSchedule.decide` with the same
  :class:`Boundary` flags (``time_due`` and ``writer_busy`` come from one all-reduce MAX of each rank's own
  :meth:`SnapshotSchedule.time_due` and ``manager.in_flight``), so every rank takes the same decision.
- After each durable save it started (scheduled, final or by hand) the loop calls
  :meth:`SnapshotSchedule.started`; the time clock restarts then, and any pending snapshot is satisfied.
- A background save's duration is measured from :meth:`started` to the first boundary at which the writer
  is seen free (so at step-boundary resolution). When a save during which a snapshot had to be deferred is
  seen finished, :class:`SnapshotDecision` carries, once, a warning with the snapshot rate the storage sustains; and
  once, when ``STUCK_AFTER`` snapshots have fallen due during a single save still being written (a hung or
  very slow storage, which would otherwise go unseen now that the loop does not stall on it).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from elastic.contract.progress import LAST_SAVE_SECONDS, SNAPSHOTS_DEFERRED, SNAPSHOTS_SAVED, SNAPSHOTS_SKIPPED

__all__ = [
    "STUCK_AFTER",
    "Boundary",
    "SnapshotDecision",
    "SnapshotSchedule",
    "SnapshotStats",
    "WriterBusy",
    "writer_busy",
]

#: snapshots falling due during one save (deferred or skipped) after which the writer is reported as stuck
STUCK_AFTER = 10


class WriterBusy(str, enum.Enum):
    """What the loop does when a snapshot falls due while the previous one is still being written."""

    DEFER = "defer"  # take it at the first step boundary at which the writer is free
    WAIT = "wait"  # take it now: the save waits for the previous one (the loop stalls)


def writer_busy(value: WriterBusy | str) -> WriterBusy:
    """``value`` as a :class:`WriterBusy` (its string accepted); ``ValueError`` naming the choices otherwise."""
    try:
        return WriterBusy(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in WriterBusy)
        raise ValueError(f"when_writer_busy must be one of {choices}, got {value!r}") from None


@dataclass(frozen=True)
class SnapshotStats:
    """Counters of the durable snapshots of this run (the same on every rank).

    ``saved``: snapshots started (scheduled, deferred, final and by hand); ``deferred``: snapshots that fell due
    while the writer was busy and were taken later; ``skipped``: snapshots that fell due while one was already
    pending (merged into it). ``last_save_seconds``/``last_save_steps``: the newest measured background save,
    from its start to the first step boundary at which the writer was free."""

    saved: int = 0
    deferred: int = 0
    skipped: int = 0
    pending_since: int | None = None  # the step at which the pending snapshot fell due (None: none pending)
    last_saved_step: int | None = None
    last_save_seconds: timedelta | None = None
    last_save_steps: int | None = None

    def progress_fields(self) -> dict[str, Any]:
        """Flat JSON-able fields for the job service's progress report (its free-form ``extra``)."""
        seconds = self.last_save_seconds.total_seconds() if self.last_save_seconds is not None else None
        return {
            SNAPSHOTS_SAVED: self.saved,
            SNAPSHOTS_DEFERRED: self.deferred,
            SNAPSHOTS_SKIPPED: self.skipped,
            LAST_SAVE_SECONDS: seconds,
        }


@dataclass(frozen=True)
class Boundary:
    """One step boundary as every rank agrees on it. ``now``: this rank's ``time.monotonic()``."""

    step: int
    now: float
    epoch_done: bool = False
    time_due: bool = False  # any rank's time-based snapshot fell due
    writer_busy: bool = False  # any rank's checkpoint writer is still saving


@dataclass(frozen=True)
class SnapshotDecision:
    """What to do at a boundary: ``take`` a snapshot of this step now (in the background), or nothing.
    ``deferred``/``skipped`` say what became of a snapshot that fell due; ``warning``: log it (once)."""

    take: bool = False
    deferred: bool = False
    skipped: bool = False
    warning: str | None = None


@dataclass(frozen=True)
class _Writing:
    """A background save not yet seen finished."""

    step: int
    started: float
    behind: int = 0  # snapshots that fell due (deferred or skipped) while it was being written


@dataclass(frozen=True)
class SnapshotSchedule:
    """See the module docstring. Immutable: each transition returns the next schedule."""

    every_steps: int | None = 50
    every: timedelta | None = None
    when_busy: WriterBusy = WriterBusy.DEFER
    clock: float = 0.0  # when the last snapshot was taken or fell due (``every`` counts from it)
    stats: SnapshotStats = field(default_factory=SnapshotStats)
    writing: _Writing | None = None
    warned: bool = False  # the rate warning was given
    warned_stuck: bool = False  # the stuck-writer warning was given

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1 or None, got {self.every_steps}")
        if self.every is not None and self.every < timedelta(0):
            raise ValueError(f"save_every_seconds must be >= 0 or None, got {self.every}")
        object.__setattr__(self, "when_busy", writer_busy(self.when_busy))

    def time_due(self, now: float) -> bool:
        """This rank's view of the time-based schedule (the loop all-reduces it into ``Boundary.time_due``)."""
        return self.every is not None and now - self.clock >= self.every.total_seconds()

    def decide(self, b: Boundary) -> tuple[SnapshotSchedule, SnapshotDecision]:
        """The decision at boundary ``b`` and the schedule after it."""
        state, warning = self._observe_writer(b)
        stats = state.stats
        due = b.epoch_done or b.time_due or (self.every_steps is not None and b.step % self.every_steps == 0)
        if self.when_busy is WriterBusy.WAIT:
            return state, SnapshotDecision(take=due, warning=warning)
        pending = stats.pending_since is not None
        if pending and due:  # merged into the pending one, which will hold a newer step anyway
            stats = replace(stats, skipped=stats.skipped + 1)
        if (pending or due) and not b.writer_busy:
            return replace(state, stats=replace(stats, pending_since=None)), SnapshotDecision(
                take=True, skipped=pending and due, warning=warning
            )
        if not due:
            return replace(state, stats=stats), SnapshotDecision(warning=warning)
        if not pending:
            stats = replace(stats, deferred=stats.deferred + 1, pending_since=b.step)
        nxt = replace(state, stats=stats, clock=b.now)
        w = state.writing
        if w is not None:
            nxt = replace(nxt, writing=replace(w, behind=w.behind + 1))
            if w.behind + 1 >= STUCK_AFTER and not state.warned_stuck:
                nxt = replace(nxt, warned_stuck=True)
                warning = (
                    f"the checkpoint writer has been saving step {w.step} for {b.now - w.started:.0f} s and "
                    f"{w.behind + 1} snapshots fell due meanwhile (none taken since): storage slow or unreachable?"
                )
        return nxt, SnapshotDecision(deferred=not pending, skipped=pending, warning=warning)

    def started(self, step: int, now: float, *, background: bool) -> SnapshotSchedule:
        """A durable save of ``step`` was started (returned from ``manager.save``) at ``now``."""
        stats = replace(self.stats, saved=self.stats.saved + 1, last_saved_step=step, pending_since=None)
        writing = _Writing(step, now) if background else None
        return replace(self, stats=stats, clock=now, writing=writing)

    def _observe_writer(self, b: Boundary) -> tuple[SnapshotSchedule, str | None]:
        """Measure the background save in flight once the writer is seen free."""
        w = self.writing
        if w is None or b.writer_busy:
            return self, None
        seconds, steps = max(b.now - w.started, 0.0), max(b.step - w.step, 1)
        stats = replace(self.stats, last_save_seconds=timedelta(seconds=seconds), last_save_steps=steps)
        warn = w.behind > 0 and not self.warned and self.when_busy is WriterBusy.DEFER
        nxt = replace(self, stats=stats, writing=None, warned=self.warned or warn)
        return nxt, self._rate_warning(seconds, steps) if warn else None

    def _rate_warning(self, seconds: float, steps: int) -> str:
        took = f"a save takes {seconds:.1f} s (~{steps} steps)"
        if self.every_steps is not None:
            due = f"every {self.every_steps} steps ({self.every_steps * seconds / steps:.1f} s)"
            advice = f"taking one every ~{steps} steps; set save_every_steps >= {steps}"
        elif self.every is not None:
            due = f"every {self.every.total_seconds():.1f} s"
            advice = f"taking one every ~{seconds:.1f} s; set save_every_seconds >= {math.ceil(seconds)} s"
        else:
            due = "at each epoch end"
            advice = f"taking one every ~{steps} steps"
        return f"snapshots fall due {due} but {took}: {advice} or use faster storage"
