"""The elastic loop's guarantees for a training loop that a framework owns (Hugging Face ``Trainer``, an
``accelerate`` script): :class:`BoundarySession`, the loop's own pieces driven from the framework's step boundary.

The framework keeps its loop, its process group, its model wrapping (DDP) and its optimizer step. The session
keeps what the elastic loop keeps, with the loop's objects:

- the data: an :class:`~elastic.train.batch_sampler.ElasticBatchSampler` over the cursor's
  :class:`~elastic.train.sampler.ElasticSampler` (:class:`SessionBatchSampler`) yields this rank's micro-batches
  of each step from the cursor of the last *committed* step, so a resize or a restart serves exactly the samples
  not yet consumed; the weight of each micro-batch (:meth:`BoundarySession.next_micro_batch`) makes the summed
  gradients the exact mean over the step's samples whatever the split;
- the batch and the LR: the :class:`~elastic.contract.lr.LRPolicy`'s step plan for this world (the micro-batch and
  the accumulation steps the framework must run) and its factor with the warmup ramp after a resize, applied around
  the optimizer's ``step`` by the loop's :class:`~elastic.train.step.OptimizerGate`;
- the snapshots: the loop's :class:`~elastic.train.snapshots.LoopCheckpoints` (verified, asynchronous, to any
  fsspec URL, on the ``save_every_steps``/``save_every_seconds`` schedule), with the
  :class:`~elastic.train.cursor.TrainingCursor` (step, data cursor, LR ramp, registered state) in each;
- the restore (:meth:`BoundarySession.restore`): the newest verified snapshot, with no path to give;
- the SIGTERM save: a :class:`~elastic.train.preemption.PreemptionWatcher`; every rank saves the step at the
  boundary after the signal and the signalled ranks exit 143, as in the loop.

At the boundaries (:meth:`BoundarySession.commit`) every rank agrees on the boundary's flags
(:class:`~elastic.train.boundary.BoundaryFlags`: a SIGTERM seen anywhere, a time-based snapshot due, the writer
busy, the optimizer steps run). The all-reduce is started at one boundary and waited for at the next, every few
steps (:class:`~elastic.train.agreement.DeferredAgreement`), so the framework's gradient all-reduce hides it: what
the flags decide (a SIGTERM, a time-based snapshot) happens up to its interval later, on every rank alike.

Restart mode only: the framework forms and owns the process group, so a lost peer fails the workers and torchrun
restarts them (warm with ``-m elastic.prefork``); the session resumes from the newest snapshot at any world.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic import compat
from elastic.checkpoint import capture_training_state
from elastic.checkpoint.state import TrainingState
from elastic.contract.lr import StepPlan
from elastic.train import console
from elastic.train.agreement import checked_flags, replicas_agreement
from elastic.train.batch_sampler import ElasticBatchSampler, LockstepError
from elastic.train.boundary import BoundaryFlags
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.cursor import TrainingCursor
from elastic.train.preemption import PreemptionWatcher
from elastic.train.registry import StateRegistry
from elastic.train.sampler import step_layout
from elastic.train.snapshots import LoopCheckpoints
from elastic.train.step import OptimizerGate

logger = logging.getLogger(__name__)

__all__ = ["BoundarySession", "MicroBatch", "SessionBatchSampler"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loader served it: its samples (empty: a padding batch, weight 0) and its loss weight
    (the loop's :meth:`~elastic.train.sampler.StepLayout.weight`)."""

    indices: list[int]
    weight: float
    accumulation: int  # micro-batches of its step on this rank
    global_batch: int  # samples of its step, all ranks together


class SessionBatchSampler(ElasticBatchSampler):
    """The loop's batch sampler, bound to a session's cursor: it yields this rank's micro-batches from the committed
    cursor and records each one's samples and weight for :meth:`BoundarySession.next_micro_batch`. Its ``len`` is
    a whole epoch's micro-batches at this world (what a framework computes its steps per epoch from), whatever the
    cursor: a framework's ``max_steps`` derived from epochs is then the same on every restart."""

    def __init__(
        self,
        data_source: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__(data_source, seed=seed, shuffle=shuffle, replacement=replacement, num_samples=num_samples)
        self._layouts: deque[MicroBatch] = deque()
        self.finished = False  # the run is over (a restored run that had reached its end): nothing more to serve

    def __iter__(self) -> Iterator[list[int]]:
        served: deque[MicroBatch] = deque()
        self._layouts = served  # an older iterator's unconsumed batches are void
        if self.finished:
            return
        ahead = self.sampler.copy()
        epoch = ahead.epoch
        while ahead.epoch == epoch and ahead.remaining() > 0:
            plan = self.plan()
            layout = step_layout(ahead, plan.global_batch, plan.accumulation_steps)
            for j, idx in enumerate(layout.micro):
                served.append(
                    MicroBatch(list(idx), layout.weight(j, ahead.world_size), len(layout.micro), layout.total)
                )
                yield idx or [layout.pad_index]
            ahead.advance(plan.global_batch)

    def __len__(self) -> int:
        plan = self.plan()
        return math.ceil(self.sampler.epoch_size / plan.global_batch) * plan.accumulation_steps

    def next_served(self) -> MicroBatch:
        if not self._layouts:
            raise LockstepError("the loader served a batch its ElasticBatchSampler did not yield")
        return self._layouts.popleft()


class BoundarySession:
    """See the module docstring.

    Args:
        config: the loop's settings (``lr_policy``, ``checkpoint_url``, ``save_every_steps``, ...; ``recovery`` must
            be left unset or ``"restart"``).
        data: the training data set (its ``len``).
        device: where the boundary's all-reduce runs (the framework's device: CUDA with NCCL, else CPU).
        on_step: called with each committed step's :class:`~elastic.train.config.StepInfo` on this rank.
    """

    def __init__(
        self,
        config: ElasticConfig,
        data: Sized | int,
        device: torch.device,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> None:
        compat.check_torch_version()
        console.attach()  # the resume and the SIGTERM save show on stderr when the script configures no logging
        if config.recovery is not None and config.recovery.value != "restart":
            raise ValueError(
                "the framework owns the process group: live recovery is not available here, leave "
                "recovery unset (restart mode, with warm starts under -m elastic.prefork)"
            )
        self.config = config
        self.device = device
        self._on_step = on_step
        if not _group_up():  # a plain ``python train.py``: a world of one, as the loop makes it
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            logger.info("elastic: no process group (not started by torchrun): a world of one process")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.batch_sampler = SessionBatchSampler(data, seed=config.seed, shuffle=config.shuffle)
        self.registry = StateRegistry()
        self.cursor = TrainingCursor(
            config.lr_policy, self.batch_sampler.sampler, self.rank, self.world_size, self.registry
        )
        self.batch_sampler.bind(lambda world: self.cursor.policy.step_plan(world))
        self.checkpoints = LoopCheckpoints(config, None, device)
        self.watcher = PreemptionWatcher()
        self._gate: OptimizerGate | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._module: torch.nn.Module | None = None
        self._scheduler: Any = None
        self._agreement = replicas_agreement(self.world_size, device, lambda: None)  # the default group
        self._lr_hook: Any = None
        self._restored_step: int | None = None  # the step of the snapshot restored at start (it need not be saved)
        self._indices: list[int] = []  # this rank's samples of the step in progress
        self._global_batch = 0
        self._loss = 0.0
        self._lr = 0.0
        self._closed = False

    # -- set-up ----------------------------------------------------------------------------------------
    @property
    def plan(self) -> StepPlan:
        """The step plan at this world: the global batch, this rank's micro-batch and accumulation steps."""
        return self.cursor.policy.step_plan(self.world_size)

    @property
    def step(self) -> int:
        return self.cursor.step

    @property
    def lr_factor(self) -> float:
        return self.cursor.lr_factor

    def register_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (``state_dict``/``load_state_dict``) with every snapshot; before :meth:`restore`."""
        self.registry.register(name, obj)

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """The framework made its model, optimizer and scheduler: gate the optimizer's ``step`` with the LR factor.
        ``module``: the model itself (not its DDP wrapper); ``optimizer``: the torch optimizer (not a wrapper)."""
        if self._gate is not None:
            self._gate.close()
            self._lr_hook.remove()
        self._module, self._optimizer, self._scheduler = module, optimizer, scheduler
        self._gate = OptimizerGate((optimizer,), lambda: self.lr_factor, lambda: False)
        # runs inside the gated step, where the LR is the one applied (the scheduler may step before the boundary)
        self._lr_hook = optimizer.register_step_pre_hook(self._note_lr)

    def _note_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._lr = float(optimizer.param_groups[0]["lr"])

    def restore(self) -> bool:
        """Every rank restores the newest verified snapshot (model, optimizer, scheduler, cursor, RNG, registered
        state; a collective). False: a fresh start. Installs the SIGTERM watcher."""
        self.watcher.install()
        assert self._module is not None and self._optimizer is not None, "attach() first"
        restored = self.checkpoints.restore(
            self._module, self._optimizer, self._scheduler, self.cursor, self.rank, self.world_size
        )
        self._restored_step = self.step if restored else None
        return restored

    # -- the step --------------------------------------------------------------------------------------
    def next_micro_batch(self) -> MicroBatch:
        """The micro-batch the framework is about to run (in the order the loader served them)."""
        micro = self.batch_sampler.next_served()
        self._indices.extend(micro.indices)
        self._global_batch = micro.global_batch
        return micro

    def add_loss(self, value: float) -> None:
        """This rank's weighted loss of a micro-batch (for :class:`StepInfo` only)."""
        self._loss += value

    def commit(self) -> bool:
        """The framework's optimizer step of this boundary ran (on every rank): the step commits (cursor, step),
        the boundary's agreed flags are acted on (snapshots, the SIGTERM save). Returns whether the epoch ended.
        Raises ``SystemExit(143)`` on a rank that was SIGTERM'd, once the step is saved."""
        assert self._gate is not None and self._optimizer is not None
        stepped = self._gate.take()
        global_batch = self._global_batch or self.plan.global_batch
        lr = self._lr if stepped else float(self._optimizer.param_groups[0]["lr"]) * self.lr_factor
        epoch = self.cursor.sampler.epoch
        epoch_done = self.cursor.sampler.advance(global_batch)
        self.cursor.step += 1
        if self._on_step is not None:
            self._on_step(StepInfo(self.step, epoch, self.rank, self.world_size, list(self._indices), lr, self._loss))
        self._indices, self._global_batch, self._loss = [], 0, 0.0
        signalled = self.watcher.requested

        def mine(acted_at: int) -> BoundaryFlags:  # this rank's view of boundary `acted_at`, when asked
            flags = self.checkpoints.local_flags(acted_at, time.monotonic(), signalled, self.rank)
            return flags.with_steps(stepped, joiners=False)

        needed = self.checkpoints.flags_needed(self.step, epoch_done)
        flags = checked_flags(self._agreement.agreed(self.step, stepped, mine, needed=needed))
        module, optimizer = self._module, self._optimizer
        assert module is not None
        self.checkpoints.warm_up(module, optimizer, self._scheduler, self.cursor)
        stop = self.checkpoints.act(flags, self.step, epoch_done, self.rank, signalled, self._capture, optimizer)
        if stop:
            self._stop()
        self._agreement.launch(self.step, mine, soon=self.checkpoints.flags_needed(self.step + 1, epoch_done=False))
        return epoch_done

    def _capture(self) -> TrainingState:
        assert self._module is not None
        return capture_training_state(self.step, self._module, self._optimizer, self._scheduler, **self.cursor.state())

    def _stop(self) -> None:
        logger.warning("SIGTERM: step %d saved; exiting", self.step)
        self.close(finished=False)
        raise SystemExit(143)

    @property
    def last_lr(self) -> float:
        """The LR applied at the last committed step (the optimizer's first group's times the policy's factor)."""
        return self._lr

    # -- the end ---------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The framework's training ended (every rank): a signal seen at the last boundary is acted on, the last
        step is saved unless a snapshot of it exists, and the snapshots are flushed."""
        flags = checked_flags(self._agreement.drain(BoundaryFlags(signalled=self.watcher.requested)))
        if flags is not None and flags.signalled:
            assert self._optimizer is not None
            self.checkpoints.act(
                flags, self.step, False, self.rank, self.watcher.requested, self._capture, self._optimizer
            )
        saved = self.checkpoints.stats.last_saved_step == self.step or self._restored_step == self.step
        if self.checkpoints.manager is not None and not saved:
            logger.info("training ended at step %d: saving it", self.step)
            assert self._optimizer is not None
            self.checkpoints.save(self.step, self._capture, self._optimizer, blocking=True)
        self.close(finished=True)

    def close(self, finished: bool = True) -> None:
        """Flush the snapshots and put the optimizer's ``step`` and the signal handlers back (once)."""
        if self._closed:
            return
        self._closed = True
        self._agreement.discard()
        self.watcher.uninstall()
        if self._gate is not None:
            self._gate.close()
            self._lr_hook.remove()
        self.checkpoints.close(finished=finished)

    @property
    def resumed_from(self) -> str | None:
        return self.checkpoints.source


def _group_up() -> bool:
    return dist.is_available() and dist.is_initialized()
