"""The worker-side elastic loop: a few lines turn a DDP script into an elastic, resumable one (docs/open-loop.md).

    trainer = ElasticTrainer(model, optimizer, loader_or_dataset, ElasticConfig(lr_policy=..., checkpoint_url=...))
    for x, y in trainer.batches(epochs=3):          # the short form: the loop steps the optimizer(s)
        trainer.backward(loss_fn(trainer.model(x), y))
    for step in trainer.steps(max_steps=1000):      # the own-step form: the script's GradScaler, clipping, ...
        for x, y in step:
            step.backward(loss_fn(trainer.model(x), y), scaler)
        scaler.step(optimizer); scaler.update()
    trainer.close()

What it does, in order: joins the process group torchrun describes (or a world of one without torchrun); checks
the checkpoint storage; restores the newest verified snapshot (model, optimizers, scheduler, data cursor, RNG,
registered state); makes the replicas identical; then, for each step, serves this rank's share of exactly the
samples not yet consumed (micro-batches under ``no_sync`` as the LR policy's plan says for this world), weighs each
loss for the exact mean over the global batch, applies the policy's LR factor around each optimizer's step
(:class:`~elastic.train.step.OptimizerGate`), steps the scheduler, advances the cursor, and at the step boundary
agrees with the other ranks (:mod:`~elastic.train.boundary`, :mod:`~elastic.train.agreement`) on the snapshots
due (asynchronous, deferred while the writer is busy: :mod:`~elastic.train.schedule`), a SIGTERM (everyone saves,
the signalled workers stop) and the optimizer steps that ran (:class:`~elastic.train.step.StepMismatchError`).

Everything that depends on the mode (joining the group, wrapping the model, ``no_sync``, completing a step's
gradients, the state a snapshot captures, a lost peer, re-forming, leaving) is the
:class:`~elastic.train.strategy.ParallelStrategy`'s, chosen once (:mod:`~elastic.train.strategy_factory`): DDP in
restart mode; live recovery (``recovery="live"``: the survivors drop the step, re-form and go on in the same
processes, :mod:`~elastic.train.strategy_live`); FSDP2/HSDP (``parallelize=fn(module, mesh)``, sharded anew for
each world, or a module the script sharded, :mod:`~elastic.train.strategy_sharded`). The data source is
:mod:`~elastic.train.data`'s, progress :mod:`~elastic.train.loop_progress`'s, the snapshots
:mod:`~elastic.train.snapshots`'. This module is the loop: steps and batches, the boundary, the cursor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from elastic import compat
from elastic.checkpoint import capture_training_state
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.tiers import LocalSnapshotStats
from elastic.contract.lr import LRPolicy
from elastic.live.protocol import ReformReason
from elastic.train.agreement import checked_flags
from elastic.train.boundary import BoundaryFlags
from elastic.train.collectives import leave_process_group, mean_over_workers
from elastic.train.config import ElasticConfig, LiveOptions, RecoveryMode, StepInfo
from elastic.train.cursor import TrainingCursor
from elastic.train.data import StreamData, source_sampler, step_data
from elastic.train.host_malloc import keep_freed_memory
from elastic.train.loop_progress import LoopProgress
from elastic.train.parallel import Parallelize
from elastic.train.preemption import PreemptionWatcher
from elastic.train.registry import loop_registry
from elastic.train.sampler import ElasticSampler, step_layout
from elastic.train.schedule import SnapshotStats, WriterBusy
from elastic.train.snapshots import LoopCheckpoints
from elastic.train.step import OptimizerGate, Step, StepHost, StepMismatchError, as_optimizers, steps_end
from elastic.train.step_loss import StepLoss
from elastic.train.stop_timeout import StopTimeout
from elastic.train.strategy import LoopParts
from elastic.train.strategy_factory import create_strategy

logger = logging.getLogger(__name__)

__all__ = [
    "ElasticConfig",
    "ElasticTrainer",
    "LiveOptions",
    "RecoveryMode",
    "SnapshotStats",
    "Step",
    "StepInfo",
    "StepMismatchError",
    "WriterBusy",
]


class ElasticTrainer:
    """See the module docstring. The optimizer must be created with ``lr = lr_policy.base_lr``.
    ``checkpoint_storage`` replaces the storage built from the checkpoint URL (a wrapper of our own
    :class:`~elastic.checkpoint.storage.CheckpointStorage`; its URL is used when the config names none)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        data: Any,
        config: ElasticConfig,
        *,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        on_step: Callable[[StepInfo], None] | None = None,
        checkpoint_storage: CheckpointStorage | None = None,
        parallelize: Parallelize | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
        model: the model (plain, DDP-wrapped by the script, FSDP2-sharded by the script, or plain with
            ``parallelize``).
        optimizer: the optimizer, or several (a GAN's, a sparse and a dense one): the loop applies the LR
            factor around each one's ``step`` and saves them all (the first in the snapshot's optimizer entry,
            the others as registered state ``optimizer.1``, ...).
        data: a ``DataLoader`` over an :class:`~elastic.train.batch_sampler.ElasticBatchSampler` (the script's
            own loader: workers, pinned memory, ``collate_fn``), or a map-style data set that the loop collates
            in this process with ``collate_fn``.
        config: the loop's settings (:class:`ElasticConfig`).
        scheduler: an LR scheduler the loop steps once per committed step and saves.
        collate_fn: for a data set passed as ``data``.
        on_step: called with each committed step's :class:`StepInfo` (sample accounting, progress hooks).
        checkpoint_storage: replaces the storage built from the checkpoint URL.
        parallelize: ``fn(module, mesh)`` that shards the model for each world (FSDP2/HSDP).
        state: objects with ``state_dict``/``load_state_dict`` to save and restore with the rest, by name
            (as :meth:`register_state`).
        """
        compat.check_torch_version()
        keep_freed_memory()  # a step's multi-MiB temporaries stay mapped (elastic.train.host_malloc)
        self.config = config
        self._on_step = on_step
        self.optimizers = optimizers = as_optimizers(optimizer)
        self.optimizer = optimizers[0]
        self.scheduler = scheduler
        self._registry = loop_registry(optimizers, state)
        # the mode (restart or live; DDP, the live all-reduce or FSDP2) is the strategy's, chosen once
        self._strategy = create_strategy(model, parallelize, optimizers, config)
        self.device = self._strategy.join()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._host = self._strategy.host_collectives(self.device)
        self._agreement = self._strategy.agreement(self._host, self.world_size)
        sampler = source_sampler(data, config.seed, config.shuffle)
        self.cursor = TrainingCursor(config.lr_policy, sampler, self.rank, self.world_size, self._registry)
        self._data = step_data(data, collate_fn, self.device).bind(lambda w: self.policy.step_plan(w), self._registry)
        self._gate = OptimizerGate(optimizers, lambda: self.lr_factor, lambda: self._strategy.dropped)
        self._step_now: Step | None = None  # the step being served
        self._step_host = StepHost(
            no_sync=lambda: self._strategy.no_sync(),
            fetch=lambda layout: self._data.micro_batches(layout),
            gradients_done=self._gradients_done,
            run_backward=self._run_backward,
            broken=lambda: self._strategy.dropped,
            peer_lost=lambda exc: self._strategy.peer_failed(exc),
        )
        self._backward_pending = False  # the short form: a micro-batch yielded whose backward has not run
        self._checkpoints = LoopCheckpoints(
            config,
            checkpoint_storage,
            self.device,
            require_storage=self._strategy.storage_required,
            sharded=self._strategy.sharded,
            shards=self._strategy.shards,
            loop_state=self._loop_state,
        )
        # restores the newest snapshot (or receives a live peer's state) and makes the replicas identical
        self.model: torch.nn.Module = self._strategy.start(
            LoopParts(self.device, self.optimizer, scheduler, self.cursor, self._checkpoints, self._host, self._record)
        )
        self._stop_timeout = StopTimeout(config.stop_timeout, lambda: self.step)
        self._preemption = PreemptionWatcher(on_signal=self._stop_timeout.arm).install()
        self._progress = LoopProgress(config, self._checkpoints, self._host, self.rank)
        self._progress.started(self.step, self.world_size)
        self._loss = StepLoss()  # read at the boundary without draining the device's queue
        self._stopped = False

    # -- the cursor ----------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The model itself: the module inside :attr:`model`'s DDP (or live) wrapper, or the sharded model."""
        return self._strategy.module

    @property
    def step(self) -> int:
        return self.cursor.step

    @property
    def sampler(self) -> ElasticSampler:
        return self.cursor.sampler

    @property
    def policy(self) -> LRPolicy:
        return self.cursor.policy

    @property
    def lr_factor(self) -> float:
        return self.cursor.lr_factor

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) * self.lr_factor

    @property
    def generation(self) -> int | None:
        """Live recovery: the number of the live group's generation this worker trains in (else None)."""
        return self._strategy.generation

    @property
    def mesh(self) -> Any:
        """A model passed with ``parallelize=``: the current world's (replicate, shard) ``DeviceMesh`` (else None)."""
        return self._strategy.mesh

    @property
    def shard_size(self) -> int | None:
        """A model passed with ``parallelize=``: the ranks of one replica (the mesh's "shard" dimension)."""
        return self._strategy.shard_size

    # -- the loop ------------------------------------------------------------------------------------
    def steps(
        self, epoch: int | None = None, *, epochs: int | None = None, max_steps: int | None = None
    ) -> Iterator[Step]:
        """The own-step form: yield each optimizer step as a :class:`~elastic.train.step.Step`; the script iterates
        it for its micro-batches and steps its optimizer(s) itself (see :mod:`elastic.train.step`). The step
        commits when the next one is asked for.

        Args:
            epoch: serve what is left of this epoch (nothing if a resumed run is past it).
            epochs: serve everything until this many epochs are done.
            max_steps: stop once this many steps are committed (with ``epochs``: whichever comes first), and
                take a final snapshot (synchronously) if the last step has none.
        """
        return self._run(self._end(epoch, epochs, max_steps), max_steps)

    def batches(
        self, epoch: int | None = None, *, epochs: int | None = None, max_steps: int | None = None
    ) -> Iterator[Any]:
        """The short form: yield this rank's micro-batches; each must get one :meth:`backward`. The optimizer
        step runs inside, after the last micro-batch of each step. Arguments as :meth:`steps`.

        In live mode a step whose group broke is dropped and served again, split over the new group.
        """
        for step in self._run(self._end(epoch, epochs, max_steps), max_steps):
            for batch in step:
                self._backward_pending = True
                yield batch
                if self._backward_pending:
                    raise RuntimeError("trainer.backward(loss) must be called once for every batch")
            if step.complete and not step.dropped:
                for opt in self.optimizers:
                    opt.step()

    def _end(self, epoch: int | None, epochs: int | None, max_steps: int | None) -> int | None:
        return steps_end(epoch, epochs, max_steps, self.sampler.epoch, isinstance(self._data, StreamData))

    def _run(self, end: int | None, max_steps: int | None) -> Iterator[Step]:
        self._registry.close()  # registration ends with the first step
        while (
            not self._stopped
            and (end is None or self.sampler.epoch < end)
            and (max_steps is None or self.step < max_steps)
        ):
            plan = self.policy.step_plan(self.world_size)
            layout = step_layout(self.sampler, plan.global_batch, plan.accumulation_steps)
            info = StepInfo(
                self.step + 1,
                self.sampler.epoch,
                self.rank,
                self.world_size,
                list(layout.indices),
                0.0,
                None,
                generation=self.generation,
            )
            self._strategy.begin_step(info, plan.global_batch)  # its record: lr and loss once applied
            self._gate.take()
            step = self._step_now = Step(self._step_host, layout, self.step + 1, self.sampler.epoch, self.world_size)
            yield step
            if not self._strategy.dropped and not step.complete:
                raise RuntimeError(f"step {step.index}: iterate all of its micro-batches before the next step")
            if not self._strategy.dropped:
                self._finish_step(plan.global_batch)
            if self._strategy.dropped:
                self._recover(ReformReason.FAILURE)
        self._step_now = None
        self._settle()
        if max_steps is not None and self.step >= max_steps and not self._stopped:
            self._final_snapshot()

    def _settle(self) -> None:
        """The steps ended: the last boundary's agreement, if still in flight, is waited for and its steps checked
        (its snapshot flags come too late: the end of the steps has its own snapshot)."""
        try:
            agreed = self._agreement.drain()
        except RuntimeError as exc:
            self._collective_failed(exc)
            return
        checked_flags(agreed)

    def _final_snapshot(self) -> None:
        """``max_steps`` reached: the last step is saved (synchronously) unless a snapshot of it exists."""
        if self._checkpoints.manager is None or self.snapshot_stats.last_saved_step == self.step:
            return
        logger.info("max_steps reached at step %d: saving it", self.step)
        self.save(blocking=True)

    def register_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (anything with ``state_dict``/``load_state_dict``: an EMA model, a
        ``GradScaler``, a counter) with the rest of the state, in every snapshot tier and to a live joiner; a
        restored snapshot's state for ``name`` is loaded into it now. Register before the first step.

        Args:
            name: its key in the snapshots (unique).
            obj: the object.
        """
        self._registry.register(name, obj)

    def backward(self, loss: torch.Tensor, scaler: Any = None) -> None:
        """Backward of the mean loss over the micro-batch just served, weighted for the exact mean over the step
        (``step.backward``); ``scaler``: a ``GradScaler`` that scales it first."""
        if self._step_now is None:
            raise RuntimeError("trainer.backward(loss) belongs to a micro-batch of batches() or steps()")
        self._backward_pending = False
        self._step_now.backward(loss, scaler)

    def _collective_failed(self, exc: RuntimeError) -> None:
        """A collective failed: a lost peer in live mode drops the step (the group re-forms at the end of it);
        otherwise (restart mode, or the training code's own error) it is raised."""
        if not self._strategy.peer_failed(exc):
            raise exc

    def _recover(self, reason: ReformReason) -> None:
        """The group re-forms (after a dropped step, to admit joiners, without SIGTERM'd members) where the strategy
        re-forms in process; the loop then goes on in the new world. Restart mode: nothing to do."""
        if not self._strategy.reform(reason):
            return
        self._gate.zero_grad()  # every optimizer's share of a dropped step's gradients (the re-served step adds up)
        self._loss.discard()
        self._data.reset()  # what the loader read ahead was split for the old group
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = self._strategy.wrap()
        self._stop_timeout.restart_clock()
        self._progress.regrouped(self.step, self.rank, self.world_size)

    def _gradients_done(self) -> None:
        """The step's last micro-batch is done: the strategy completes its gradients (live mode's all-reduce)."""
        try:
            self._strategy.finish_gradients(self.world_size)
        except RuntimeError as exc:
            self._collective_failed(exc)

    def _run_backward(self, loss: torch.Tensor, weight: float, padding: bool, scaler: Any) -> None:
        if self._strategy.dropped:
            return
        if not padding:
            self._loss.add(loss, weight)  # before the backward is queued: see elastic.train.step_loss
        try:
            weighted = loss * weight
            (weighted if scaler is None else scaler.scale(weighted)).backward()
        except RuntimeError as exc:
            self._collective_failed(exc)

    def _finish_step(self, global_batch: int) -> None:
        self._stop_timeout.boundary()
        lr = self.current_lr()
        stepped = self._gate.take()
        self._gate.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        epoch_done = self.sampler.advance(global_batch)
        self.cursor.step += 1
        loss = self._loss.take()
        self._strategy.step_applied(lr, loss)  # restart mode: recorded now; live: once committed
        # Every rank agrees on the boundary's flags (live mode: at each boundary, the step's commit point, so its
        # record is written only now; DDP: every few steps, overlapped with the next one: elastic.train.agreement)
        signalled = self._preemption.requested

        def mine(acted_at: int) -> BoundaryFlags:  # this rank's view of boundary `acted_at`, when asked
            flags = self._checkpoints.local_flags(acted_at, time.monotonic(), signalled, self.rank)
            return flags.with_steps(stepped, joiners=self._strategy.joiners_waiting(self.rank))

        try:
            needed = self._checkpoints.flags_needed(self.step, epoch_done)
            agreed = self._agreement.agreed(self.step, stepped, mine, needed=needed)
        except RuntimeError as exc:
            self._collective_failed(exc)
            return
        flags = checked_flags(agreed)  # StepMismatchError where its optimizer(s) ran on some ranks only
        if stepped == 0:
            logger.info(
                "step %d: the optimizer(s) did not step here (a skipped step); its samples count as consumed", self.step
            )
        self._strategy.step_committed()
        try:
            self._progress.log_loss(self.step, self.sampler.epoch, lr, loss)
            stop = self._act(flags, epoch_done, signalled)
            if not stop:
                soon = self._checkpoints.flags_needed(self.step + 1, epoch_done=False)
                self._agreement.launch(self.step, mine, soon=soon)
        except RuntimeError as exc:
            self._collective_failed(exc)
            return
        self._publish_progress(lr, loss)
        if stop:
            self._stop_after_notice(lr, loss)
        if flags is not None and flags.joiners and not self._stopped:
            self._recover(ReformReason.ADMIT)  # workers registered since: admit them at this boundary

    def _record(self, info: StepInfo) -> None:
        if self._on_step is not None:
            self._on_step(info)

    def _act(self, flags: BoundaryFlags | None, epoch_done: bool, signalled: bool) -> bool:
        """The boundary's snapshots (None: no flags agreed here); True when this rank must stop now (SIGTERM'd, and
        the step is saved)."""
        if flags is not None and flags.signalled:
            self._stop_timeout.reached()
        self._checkpoints.warm_up(self.module, self.optimizer, self.scheduler, self.cursor)
        stop = self._checkpoints.act(flags, self.step, epoch_done, self.rank, signalled, self._capture, self.optimizer)
        if stop:
            self._stopped = True
            return True
        if flags is not None and flags.signalled:
            self._recover(ReformReason.FAILURE)  # the signalled members leave: a live group re-forms without them
        return False

    def _stop_after_notice(self, lr: float, loss: float | None) -> None:
        """SIGTERM'd and this step saved: close the snapshots (the save's commit is waited for), report the step with
        the snapshot it committed (the controller's status showed the snapshot before it) and write that report,
        leave (live: the others re-form without waiting for this member) and exit 143."""
        self._checkpoints.close(finished=False)
        self._progress.close_stopped(self.step, self.world_size, self.sampler.epoch, lr, loss)
        self._strategy.leave()  # live: revoke the lease, the others re-form without waiting for it
        raise SystemExit(143)

    def _publish_progress(self, lr: float, loss: float | None) -> None:
        self._progress.publish(self.step, self.world_size, self.sampler.epoch, lr, loss)

    def average(self, values: dict[str, float]) -> dict[str, float]:
        """Mean of each value over all workers (one all-reduce); a collective: every rank must call it."""
        return mean_over_workers(values, self._host.device, self._host.group())

    # -- checkpoints ---------------------------------------------------------------------------------
    def _loop_state(self) -> dict[str, Any]:
        """The loop's state without the model's (this rank's RNG only: no collective)."""
        return capture_training_state(
            self.step, torch.nn.Module(), None, self.scheduler, gather_rng=False, **self.cursor.state()
        ).to_dict()

    def _capture(self) -> TrainingState | dict[str, Any]:
        """References to the full state (a collective: gathers every rank's RNG state, and a stream's loader
        states)."""
        if isinstance(self._data, StreamData):
            self._data.states.gather(self._host.group())
        return self._strategy.capture(self.step)

    def save(self, blocking: bool = False) -> None:
        """Snapshot the full state now (a collective: every rank must call it)."""
        self._checkpoints.save(self.step, self._capture, self.optimizer, blocking)

    @property
    def snapshot_stats(self) -> SnapshotStats:
        """Durable snapshots saved, deferred (writer busy) and skipped so far (the same on every rank)."""
        return self._checkpoints.stats

    @property
    def local_snapshot_stats(self) -> LocalSnapshotStats:
        """This rank's node-local snapshots written, skipped (the last one still being written) and failed."""
        return self._checkpoints.local_stats

    @property
    def local_snapshot_in_flight(self) -> bool:
        """Whether this rank's last node-local snapshot is still being written (one due now would be skipped)."""
        return self._checkpoints.local_in_flight

    @property
    def resumed_from(self) -> str | None:
        """Which tier the start-up restore used: ``"durable"``, ``"node-local"``, or None (a fresh start)."""
        return self._checkpoints.source

    @property
    def stopped_by_preemption(self) -> bool:
        return self._stopped

    def close(self, finished: bool = True) -> None:
        """Flush the in-flight save (raising its error) and leave the process group. ``finished``: the job
        is done, so this node's in-memory snapshots are deleted (kept after a preemption stop), and a deferred
        snapshot still pending is taken now, synchronously, of the state at this call (a collective then)."""
        pending = self._checkpoints.stats.pending_since
        if finished and not self._stopped and pending is not None and self._checkpoints.manager is not None:
            logger.info("taking the snapshot pending since step %d at step %d before closing", pending, self.step)
            self.save(blocking=True)
        try:
            if finished and not self._stopped:
                self._settle()  # the steps were left early: the last boundary's agreement is still in flight
            self._agreement.discard()
            self._stop_timeout.reached()
            self._preemption.uninstall()
            self._data.close()
            self._gate.close()
            self._checkpoints.close(finished=finished and not self._stopped)
            self._progress.close_finished(self.step, self.world_size, self.sampler.epoch, self.current_lr())
            leave_process_group()
            self._strategy.leave(finished=finished and not self._stopped and self.rank == 0)
        finally:
            self._strategy.close()  # the user's module keeps no hook of ours, whatever failed above

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(finished=exc[0] is None)
