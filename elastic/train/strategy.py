"""How the trainer's model runs in parallel and what a failure does: :class:`ParallelStrategy`, the one interface the
loop (:class:`~elastic.train.trainer.ElasticTrainer`) calls for everything that depends on the mode.

One object per mode, chosen once by :func:`elastic.train.strategy_factory.create_strategy` from the config and the
model:

- :class:`~elastic.train.strategy_ddp.DDPStrategy`: restart mode, replicated state: torch's
  ``DistributedDataParallel``, or the script's own DDP wrap;
- :class:`~elastic.train.strategy_live.LiveReplicatedStrategy`: live recovery, replicated state: the loop's own
  gradient all-reduce (:class:`~elastic.live.grads.LiveDataParallel`, no DDP);
- :class:`~elastic.train.strategy_sharded.ShardedStrategy`: FSDP2/HSDP, a model the trainer shards for each world
  (``parallelize=``, restart or live) or one the script sharded itself (restart).

A strategy is two things: the parallel wrapping of the model (its own: wrap, ``no_sync``, the end of a step's
gradients, the state a snapshot captures) and a :class:`Recovery` (what a failure does, shared by the sharded
strategy's two modes): :class:`RestartRecovery` here (a failure stops every worker; the agent restarts them all from
a snapshot), :class:`~elastic.train.strategy_live.LiveGroupRecovery` for live recovery (the survivors re-form in
process). The strategy's recovery methods hand over to it.

The contract, in the order the loop calls it:

1. construction (the factory): checks only, no process group, no collective; a model, optimizers and recovery
   mode that no strategy trains raise :class:`StrategyError` (a ``ValueError``) there;
2. :meth:`ParallelStrategy.join`: form or join the process group (a collective), return this rank's device;
3. :meth:`~ParallelStrategy.host_collectives`, :attr:`~ParallelStrategy.storage_required`,
   :attr:`~ParallelStrategy.sharded`, :attr:`~ParallelStrategy.shards`, :meth:`~ParallelStrategy.agreement`: what the
   loop builds its snapshots and step-boundary agreements with;
4. :meth:`~ParallelStrategy.start` with the loop's :class:`LoopParts`: bring this rank's state to the group's
   (restore the newest snapshot, or receive it from a live peer; replicas made identical) and return the model the
   script calls (``trainer.model``);
5. per step: :meth:`~ParallelStrategy.begin_step`; the micro-batches, all but the last under
   :meth:`~ParallelStrategy.no_sync`; :meth:`~ParallelStrategy.finish_gradients` after the last one;
   :meth:`~ParallelStrategy.step_applied` once the optimizer stepped; the boundary's agreement (with
   :meth:`~ParallelStrategy.joiners_waiting`); :meth:`~ParallelStrategy.step_committed`; snapshots through
   :meth:`~ParallelStrategy.capture`. A collective's ``RuntimeError`` goes to :meth:`~ParallelStrategy.peer_failed`:
   True (a lost peer, live recovery) drops the step (:attr:`~ParallelStrategy.dropped`) instead of raising;
6. :meth:`~ParallelStrategy.reform` after a dropped step, to admit joiners, or when members were SIGTERM'd: True
   when the group re-formed in this process (then :meth:`~ParallelStrategy.wrap` gives the model for the new
   world), False where it does not (restart mode: nothing was done);
7. :meth:`~ParallelStrategy.leave` (SIGTERM'd, or at close once the process group is gone), then
   :meth:`~ParallelStrategy.close` (always, last).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from elastic.checkpoint.state import TrainingState, capture_training_state
from elastic.live.protocol import ReformReason
from elastic.train.agreement import BoundaryAgreement, ImmediateAgreement
from elastic.train.collectives import HostCollectives, group_device, join_process_group
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.cursor import TrainingCursor
from elastic.train.parallel import ShardedModel
from elastic.train.snapshots import LoopCheckpoints

logger = logging.getLogger(__name__)

__all__ = ["LoopParts", "ParallelStrategy", "Recovery", "RestartRecovery", "StrategyError", "capture_replicated"]


class StrategyError(ValueError):
    """A model, its optimizers and a recovery mode that no strategy trains (raised before any process group
    forms)."""


@dataclass(frozen=True)
class LoopParts:
    """What a strategy acts on, the loop's: made once the process group formed (see the module docstring, 4)."""

    device: torch.device
    optimizer: torch.optim.Optimizer  # the first optimizer: the one a snapshot's optimizer entry holds
    scheduler: Any
    cursor: TrainingCursor
    checkpoints: LoopCheckpoints
    host: HostCollectives
    record: Callable[[StepInfo], None]  # the user's step hook, for each committed step


def capture_replicated(step: int, module: nn.Module, parts: LoopParts) -> TrainingState:
    """References to the full state of a replicated model (a collective: gathers every rank's RNG state)."""
    return capture_training_state(
        step, module, parts.optimizer, parts.scheduler, process_group=parts.host.group(), **parts.cursor.state()
    )


class Recovery(ABC):
    """What a failure does: how a worker joins its group, what it records for each step and when, whether a failed
    collective drops the step, and whether the group re-forms in this process."""

    #: the group re-forms in process (the loop's host collectives then run over the default group)
    live: ClassVar[bool]
    #: an unusable checkpoint storage stops the worker at start (else it is logged and saves retry)
    storage_required: ClassVar[bool]

    @abstractmethod
    def join(self, config: ElasticConfig, granularity: int) -> None:
        """Form or join the process group (a collective); ``granularity``: workers join in groups of this many
        (a sharded model's replica size)."""

    @abstractmethod
    def start(self, parts: LoopParts, state: nn.Module | ShardedModel, restore: Callable[[int, int], bool]) -> None:
        """Bring this rank's ``state`` (the replicated module, or the model the trainer shards for each world) to the
        group's (a collective): ``restore(rank, world)`` restores the newest snapshot into it, returning whether
        there was one. Live recovery also makes the replicas identical (a broadcast, or a member's state); in restart
        mode that is the strategy's (DDP's constructor broadcasts rank 0's state)."""

    @property
    @abstractmethod
    def generation(self) -> int | None:
        """The number of the live group's generation this worker trains in (restart mode: None)."""

    @abstractmethod
    def begin_step(self, info: StepInfo, global_batch: int) -> None:
        """A step starts: ``info`` is its record as far as known (no LR or loss yet)."""

    @abstractmethod
    def step_applied(self, lr: float, loss: float | None) -> None:
        """The step's optimizer step ran here (before the boundary's agreement)."""

    @abstractmethod
    def step_committed(self) -> None:
        """Every rank agreed on the step's boundary: it is committed."""

    @abstractmethod
    def joiners_waiting(self, rank: int) -> bool:
        """This rank's view: workers wait to be admitted at this boundary."""

    @abstractmethod
    def peer_failed(self, exc: RuntimeError) -> bool:
        """Whether ``exc``, raised by a collective of the step, is a lost peer that drops the step (then
        :attr:`dropped` until the re-form); False: the caller raises it."""

    @property
    @abstractmethod
    def dropped(self) -> bool:
        """The step in progress is dropped: a peer was lost in its collectives."""

    @abstractmethod
    def reform(self, reason: ReformReason) -> bool:
        """Re-form the group in this process and bring this worker in line with it; False where the group does
        not re-form in process (nothing done)."""

    @abstractmethod
    def leave(self, finished: bool) -> None:
        """Leave the group (the others need not wait for this worker); ``finished``: the job is done (rank 0)."""


class RestartRecovery(Recovery):
    """Restart mode: the process group torchrun describes; a failed collective raises, the agent then restarts every
    worker from a snapshot. So a step's record is written once its optimizer step ran (a failure from there on
    restarts from a snapshot anyway), and nothing re-forms here."""

    live = False
    storage_required = True

    def __init__(self) -> None:
        self._parts: LoopParts | None = None
        self._info: StepInfo | None = None

    def join(self, config: ElasticConfig, granularity: int) -> None:
        join_process_group(config.resolved_backend(), config.timeout)

    def start(self, parts: LoopParts, state: nn.Module | ShardedModel, restore: Callable[[int, int], bool]) -> None:
        """Shard the model for this world (a model the trainer shards), then restore the newest snapshot."""
        self._parts = parts
        rank, world = dist.get_rank(), dist.get_world_size()
        if isinstance(state, ShardedModel):
            state.build(rank, world)
        restore(rank, world)

    @property
    def generation(self) -> int | None:
        return None

    def begin_step(self, info: StepInfo, global_batch: int) -> None:
        self._info = info

    def step_applied(self, lr: float, loss: float | None) -> None:
        assert self._parts is not None and self._info is not None
        self._parts.record(dataclasses.replace(self._info, lr=lr, loss=loss))

    def step_committed(self) -> None:
        self._info = None

    def joiners_waiting(self, rank: int) -> bool:
        return False

    def peer_failed(self, exc: RuntimeError) -> bool:
        return False

    @property
    def dropped(self) -> bool:
        return False

    def reform(self, reason: ReformReason) -> bool:
        return False  # the signalled workers exit; torchrun restarts the group

    def leave(self, finished: bool) -> None:
        return None


class ParallelStrategy(ABC):
    """The mode-dependent half of the loop (see the module docstring for the contract and the order of the calls).
    Subclasses own the model's parallel wrapping; the recovery methods hand over to :attr:`recovery`."""

    #: snapshots in the sharded layout (DCP), node-local ones per shard
    sharded: ClassVar[bool] = False

    def __init__(self, config: ElasticConfig, recovery: Recovery) -> None:
        self.config = config
        self.recovery = recovery
        self._parts: LoopParts | None = None

    # -- set-up ----------------------------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        """Workers join the group in whole groups of this many (a replica of a sharded model)."""
        return 1

    def join(self) -> torch.device:
        """Form or join the process group (a collective); returns where this rank trains."""
        self.recovery.join(self.config, self.granularity)
        return group_device()

    def host_collectives(self, device: torch.device) -> HostCollectives:
        """Where the loop's step-boundary agreements run (a collective: it may make a group)."""
        return HostCollectives.for_loop(device, self.config.timeout, live=self.recovery.live)

    def agreement(self, host: HostCollectives, world_size: int) -> BoundaryAgreement:
        """When the ranks agree on a boundary's flags (:mod:`elastic.train.agreement`): at the boundary (the
        default: a live group's commit point; a sharded model's snapshots are collective writes of every rank's
        shard, which a step skipped on some ranks only must not reach)."""
        return ImmediateAgreement(host.device, host.group)

    @property
    def storage_required(self) -> bool:
        return self.recovery.storage_required

    @property
    def shards(self) -> ShardedModel | None:
        """The model the trainer shards for each world (``parallelize=``), else None."""
        return None

    @property
    def parts(self) -> LoopParts:
        if self._parts is None:
            raise RuntimeError("the strategy is started first (ParallelStrategy.start)")
        return self._parts

    @abstractmethod
    def start(self, parts: LoopParts) -> nn.Module:
        """Bring this rank's state to the group's (a collective: restored, received, broadcast) and return the
        model the script calls."""

    def _restore(self, rank: int, world: int) -> bool:
        """Restore the newest snapshot into :attr:`module` (a collective); whether there was one."""
        p = self.parts
        return p.checkpoints.restore(self.module, p.optimizer, p.scheduler, p.cursor, rank, world)

    # -- the model -------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The model itself: inside the parallel wrapper, or the sharded model."""

    @property
    def mesh(self) -> Any:
        """A model the trainer shards: the current world's (replicate, shard) ``DeviceMesh`` (else None)."""
        return None

    @property
    def shard_size(self) -> int | None:
        """A model the trainer shards: the ranks of one replica (else None)."""
        return None

    @property
    def generation(self) -> int | None:
        return self.recovery.generation

    @abstractmethod
    def wrap(self) -> nn.Module:
        """The model the script calls in the current world (after :meth:`start` and each :meth:`reform`)."""

    # -- a step ----------------------------------------------------------------------------------------
    @abstractmethod
    def no_sync(self) -> AbstractContextManager[Any]:
        """No gradient all-reduce (or reduce-scatter) for the micro-batch run inside."""

    def finish_gradients(self, world_size: int) -> None:
        """The step's last micro-batch is done: complete its gradients' averaging (a collective where the backward
        pass did not; raises what a failed collective raises). DDP's and FSDP's completed in the backward."""
        return None

    @abstractmethod
    def capture(self, step: int) -> TrainingState | dict[str, Any]:
        """References to the full state for a snapshot of ``step`` (a collective)."""

    def begin_step(self, info: StepInfo, global_batch: int) -> None:
        self.recovery.begin_step(info, global_batch)

    def step_applied(self, lr: float, loss: float | None) -> None:
        self.recovery.step_applied(lr, loss)

    def step_committed(self) -> None:
        self.recovery.step_committed()

    def joiners_waiting(self, rank: int) -> bool:
        return self.recovery.joiners_waiting(rank)

    def peer_failed(self, exc: RuntimeError) -> bool:
        return self.recovery.peer_failed(exc)

    @property
    def dropped(self) -> bool:
        return self.recovery.dropped

    # -- the group changes ------------------------------------------------------------------------------
    def reform(self, reason: ReformReason) -> bool:
        """See :meth:`Recovery.reform`; a subclass drops its own state of the step first."""
        return self.recovery.reform(reason)

    def leave(self, finished: bool = False) -> None:
        self.recovery.leave(finished)

    def close(self) -> None:
        """Release what the strategy put on the user's module (hooks); called last, whatever failed before."""
        return None
