"""When the ranks agree on a step boundary's flags (:class:`~elastic.train.boundary.BoundaryFlags`): at the boundary
itself, or overlapped with the next step. One object per mode, chosen by the strategy
(:attr:`~elastic.train.strategy.ParallelStrategy.defers_agreement`).

- :class:`ImmediateAgreement` (live recovery, sharded models, a world of one): the all-reduce runs at the boundary
  and its flags are acted on there. Live recovery needs it: the agreement is the step's commit point, and a lost
  peer must be caught at the step it broke.
- :class:`DeferredAgreement` (restart mode with DDP): the all-reduce is started at the boundary, after its
  snapshots, and waited for at the next one, where its flags are acted on. A boundary's agreement was one more point
  per step where every rank waits for the slowest: 1.5-2 ms of a 30 ms step on 2 busy cores
  (``bench/loop_overhead_bench.py --loader``), which DDP's own gradient all-reduce hides once it is overlapped with
  the next step. What is decided one step later: a time-based snapshot, a SIGTERM seen on another rank (everyone
  saves one step later), and a step whose optimizer(s) ran on some ranks only
  (:class:`~elastic.train.step.StepMismatchError` names the step). This rank's own SIGTERM is acted on at the next
  boundary either way. The flags are read after the boundary's snapshots, so a snapshot taken there is not due
  again at the next one, and a node-local snapshot's flag is asked for the next step (when one is due every step,
  it is still taken at every step). The last boundary's flags are waited for when the steps end (:meth:`drain`).

The contract, per boundary: :meth:`BoundaryAgreement.agreed` (the flags to act on now, a collective or a wait),
the boundary's actions, then :meth:`~BoundaryAgreement.launch` (nothing, or the next agreement started);
:meth:`~BoundaryAgreement.drain` once the steps end; :meth:`~BoundaryAgreement.discard` when the group is gone.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from elastic.train.boundary import BoundaryFlags
from elastic.train.step import StepMismatchError

logger = logging.getLogger(__name__)

__all__ = [
    "Agreed",
    "BoundaryAgreement",
    "DeferredAgreement",
    "ImmediateAgreement",
    "check_steps",
    "checked_flags",
    "replicas_agreement",
]

#: this rank's view of the boundary now (computed when the agreement is made or started)
LocalFlags = Callable[[], BoundaryFlags]


@dataclass(frozen=True)
class Agreed:
    """The group's flags of the boundary that ended ``step``, and how many optimizer steps this rank ran in it."""

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


def checked_flags(agreed: Agreed | None) -> BoundaryFlags:
    """The flags to act on (none set when nothing was agreed yet), once :func:`check_steps` passed."""
    if agreed is None:
        return BoundaryFlags()
    check_steps(agreed)
    return agreed.flags


class BoundaryAgreement(ABC):
    """See the module docstring. ``device`` and ``group``: where the all-reduce runs (the loop's host collectives;
    ``group`` is called for each agreement, as the group may change)."""

    #: how many boundaries after the one it is made at an agreement is acted on (a node-local snapshot's flag is
    #: asked for the step it would be taken at)
    lag: ClassVar[int]

    def __init__(self, device: torch.device, group: Callable[[], Any]) -> None:
        self._device = device
        self._group = group

    @abstractmethod
    def agreed(self, step: int, stepped: int, local: LocalFlags) -> Agreed | None:
        """The flags to act on at the boundary ending ``step`` (this rank ran ``stepped`` optimizer steps in it):
        this boundary's, or the previous one's; None when there are none yet. Raises what a failed collective
        raises."""

    def launch(self, step: int, stepped: int, local: LocalFlags) -> None:
        """After the boundary's actions: start the agreement acted on at the next one (nothing by default)."""
        return None

    def drain(self) -> Agreed | None:
        """The steps ended: the agreement still in flight, waited for (None when there is none)."""
        return None

    def discard(self) -> None:
        """The group is going away: forget what is in flight (without waiting for it)."""
        return None


class ImmediateAgreement(BoundaryAgreement):
    """One all-reduce at each boundary, acted on there."""

    lag = 0

    def agreed(self, step: int, stepped: int, local: LocalFlags) -> Agreed:
        return Agreed(step, local().agree(self._device, self._group()), stepped)


class DeferredAgreement(BoundaryAgreement):
    """Each boundary's all-reduce is started there and acted on at the next boundary (see the module docstring)."""

    lag = 1

    def __init__(self, device: torch.device, group: Callable[[], Any]) -> None:
        super().__init__(device, group)
        self._pending: _Pending | None = None

    def agreed(self, step: int, stepped: int, local: LocalFlags) -> Agreed | None:
        return self.drain()

    def launch(self, step: int, stepped: int, local: LocalFlags) -> None:
        if self._pending is not None:
            raise RuntimeError(f"step {step}: the agreement of step {self._pending.step} was never waited for")
        group = self._group()
        mine = local()
        tensor = torch.tensor(mine.encode(), device=self._device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._pending = _Pending(step, stepped, tensor, work)

    def drain(self) -> Agreed | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.work.wait()
        flags = BoundaryFlags.decode([int(v) for v in pending.tensor.tolist()])
        return Agreed(pending.step, flags, pending.stepped)

    def discard(self) -> None:
        if self._pending is not None:
            logger.debug("the agreement of step %d is dropped unread", self._pending.step)
        self._pending = None


def replicas_agreement(world_size: int, device: torch.device, group: Callable[[], Any]) -> BoundaryAgreement:
    """The agreement of replicas whose gradient all-reduce meets every rank once per step (DDP, in restart mode: the
    loop's, or a framework's): deferred, but for a world of one (nothing to agree on)."""
    if world_size == 1:
        return ImmediateAgreement(device, group)
    return DeferredAgreement(device, group)


@dataclass(frozen=True)
class _Pending:
    step: int
    stepped: int
    tensor: torch.Tensor
    work: Any  # the all-reduce's c10d Work
