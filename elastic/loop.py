"""The worker-side elastic loop: a few lines turn a DDP script into an elastic, resumable one.

    trainer = ElasticTrainer(model, optimizer, dataset, ElasticConfig(lr_policy=..., checkpoint_url=...))
    for x, y in trainer.batches(epochs=3):
        trainer.backward(loss_fn(trainer.model(x), y))
    trainer.close()

or, as a drop-in for a tutorial DDP script (the process group and ``DDP(model)`` are the user's own)::

    dist.init_process_group("gloo"); model = DDP(model)
    trainer = ElasticTrainer(model, optimizer, dataset, ElasticConfig(LRPolicy("linear", lr, 2, batch)))
    for epoch in range(epochs):
        for x, y in trainer.batches(epoch):
            trainer.backward(loss_fn(model(x), y))

What it does, in order: joins the process group torchrun describes (gloo on CPU, NCCL on GPU); checks the
checkpoint storage (a clear error before training); restores the newest verified snapshot that rank 0 picks
(model, optimizer, scheduler, data cursor, RNG, step, LR policy reference); wraps the model in DDP, which
broadcasts rank 0's parameters so replicas start identical; then, for each optimizer step, hands out this
rank's share of exactly the samples not yet consumed this epoch (split into micro-batches under ``no_sync``
for gradient accumulation), scales the loss so the gradient is the exact mean over the global batch, applies
the LR policy's factor (with its warmup ramp after a resize) around ``optimizer.step()``, steps the LR
scheduler, advances the data cursor, saves snapshots on a step/time schedule (asynchronously; optionally also
node-local ones in memory, see ``elastic/checkpoint/tiers.py``), logs progress averaged over workers, and
on SIGTERM saves synchronously at the step boundary and stops.

A snapshot that falls due while the previous one is still being written does not stall the loop (with
``when_writer_busy="defer"``, the default): it is taken at the first step boundary at which the writer is
free, holding the newest state then, while the fixed multiples of ``save_every_steps`` go on (one falling due
while one is pending is counted as skipped). The decisions are :mod:`elastic.snapshot_schedule`'s, on flags
every rank agrees on in the all-reduce each step already does; counters in :attr:`ElasticTrainer.snapshot_stats`.
A snapshot still pending when the job ends (``close(finished=True)``) is taken there, synchronously.

A SIGTERM'd worker that cannot reach the step boundary within ``stop_timeout`` (at least three times the
slowest of the last steps) is blocked in a collective with a peer that vanished without closing its
connections (a network partition, a host gone dark): it exits at once with 128+signal and no final save,
and the group re-forms from the last snapshot, instead of waiting for torchrun's SIGKILL 30 s later.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from elastic import compat
from elastic.checkpoint import (
    CheckpointFencedError,
    CheckpointWriteError,
    PreemptionWatcher,
    capture_training_state,
    create_checkpoint_manager,
    restore_training_state,
)
from elastic.checkpoint.api import CheckpointManager
from elastic.checkpoint.layout import step_dir
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.tiers import create_snapshot_tiers
from elastic.env import WorkerEnv
from elastic.loop_config import ElasticConfig, StepInfo
from elastic.lr import LRPolicy, RampState, scaled_lr
from elastic.progress import create_reporter
from elastic.sampler import ElasticSampler, split_sizes
from elastic.snapshot_schedule import Boundary, SnapshotSchedule, SnapshotStats, WriterBusy

logger = logging.getLogger(__name__)

__all__ = ["ElasticConfig", "ElasticTrainer", "SnapshotStats", "StepInfo", "WriterBusy"]


class ElasticTrainer:
    """See the module docstring. The optimizer must be created with ``lr = lr_policy.base_lr``.
    ``checkpoint_storage`` replaces the storage built from the checkpoint URL (a wrapper of our own
    :class:`~elastic.checkpoint.storage.CheckpointStorage`; its URL is used when the config names none)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        config: ElasticConfig,
        *,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        on_step: Callable[[StepInfo], None] | None = None,
        checkpoint_storage: CheckpointStorage | None = None,
    ) -> None:
        compat.check_torch_version()
        self.config = config
        self._dataset = dataset
        self._collate = collate_fn
        self._on_step = on_step
        self._storage = checkpoint_storage
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._init_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = self._pick_device()
        self.policy = config.lr_policy
        self.step = 0
        self.sampler = ElasticSampler(len(dataset), seed=config.seed, shuffle=config.shuffle)
        self.sampler.set_world(self.rank, self.world_size)
        self._ramp = self.policy.start_ramp(0, self.policy.factor(self.world_size), self.world_size)
        self._manager = self._open_checkpoints()
        self._tiers = create_snapshot_tiers(
            self._manager, config.resolved_local_every_steps(), self.device, config.local_max_overhead
        )
        if isinstance(model, DistributedDataParallel):
            # The user wrapped it already: restore into the module, then make replicas identical.
            self._restore(model.module)
            self._broadcast_module(model.module)
            self.model = model
        else:
            model.to(self.device)
            self._restore(model)
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=device_ids)  # broadcasts rank 0's state
        self._step_times: deque[float] = deque(maxlen=50)  # seconds between the last step boundaries
        self._last_boundary: float | None = None
        self._boundary_after_signal = threading.Event()  # the final save began, or the loop is over
        self._preemption = PreemptionWatcher(on_signal=self._arm_stop_timeout).install()
        self._progress = create_reporter()  # a no-op outside the job service
        self._pending_checkpoint: int | None = None
        self._progress.report(
            self.step, world_size=self.world_size, total_steps=config.total_steps, nodes=self._round_nodes(), force=True
        )
        self._schedule = SnapshotSchedule(
            config.save_every_steps, config.save_every, config.when_writer_busy, clock=time.monotonic()
        )
        self._failing_since: float | None = None  # when saves began to fail (none failing: None)
        self._loss_sum = 0.0
        self._loss_count = 0
        self._scale = 1.0
        self._backward_done = True
        self._stopped = False
        if abs(optimizer.param_groups[0]["lr"] - self.policy.base_lr) > 1e-12 and self.step == 0:
            logger.warning(
                "optimizer lr %g differs from the LR policy's base_lr %g; the policy's factor multiplies the "
                "optimizer's lr", optimizer.param_groups[0]["lr"], self.policy.base_lr,
            )  # fmt: skip

    # -- set-up --------------------------------------------------------------------------------------
    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        backend = self.config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=self.config.timeout)

    @staticmethod
    def _broadcast_module(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, 0)

    def _pick_device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _open_checkpoints(self) -> CheckpointManager | None:
        url = self.config.resolved_checkpoint_url() or (self._storage.url if self._storage is not None else None)
        if url is None:
            logger.warning("no checkpoint URL: training will not survive a restart")
            return None
        options = self.config.checkpoint_options
        worker = WorkerEnv.from_environ()
        if options.signing_key is None:  # the job service gives each job a key (elastic.env.CHECKPOINT_KEY)
            options = replace(options, signing_key=worker.checkpoint_key)
        if options.generation is None and worker.job is not None:  # fencing of an old generation's saves
            options = replace(options, generation=worker.job.generation)
        manager = create_checkpoint_manager(url, options, storage=self._storage)
        manager.check_storage()  # one clear line, before any training, if the storage is unusable
        return manager

    def _restore(self, model: torch.nn.Module) -> None:
        # Every rank restores the same snapshot: the newest verified durable one that rank 0 picks, or a
        # newer node-local one that a surviving node holds (elastic/checkpoint/tiers.py).
        state = self._tiers.restore()
        if state is None:
            return
        ts = restore_training_state(state, model, self.optimizer, self.scheduler)
        self.step = ts.step
        self.sampler.load_state_dict(dict(ts.data_cursor)["sampler"])
        if ts.lr_reference:
            stored = LRPolicy.from_reference(dict(ts.lr_reference))
            if stored != self.policy:
                logger.warning("using the LR policy stored in the checkpoint (%s), not %s", stored, self.policy)
            self.policy = stored
        saved_ramp = dict(ts.extras).get("lr_ramp")
        ramp = RampState(**saved_ramp) if saved_ramp else self._ramp
        if ts.world_size != self.world_size:
            in_force = self.policy.factor_at(self.step, ramp)
            self._ramp = self.policy.start_ramp(self.step, in_force, self.world_size)
            logger.info(
                "resized %d -> %d workers at step %d: LR factor %.6g -> %.6g over %d steps",
                ts.world_size, self.world_size, self.step, in_force, self._ramp.target_factor,
                self.policy.warmup_steps,
            )  # fmt: skip
        else:
            self._ramp = ramp
        logger.info(
            "resumed from step %d (epoch %d, position %d)", self.step, self.sampler.epoch, self.sampler.position
        )

    # -- the loop ------------------------------------------------------------------------------------
    @property
    def lr_factor(self) -> float:
        return self.policy.factor_at(self.step, self._ramp)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) * self.lr_factor

    def batches(self, epoch: int | None = None, *, epochs: int | None = None) -> Iterator[Any]:
        """Yield this rank's micro-batches; each must get one :meth:`backward`. The optimizer step runs
        inside, after the last micro-batch of each step.

        ``batches(epoch)`` serves what is left of that epoch (nothing if a resumed run is already past it);
        ``batches(epochs=N)`` serves everything until N epochs are done.
        """
        if (epoch is None) == (epochs is None):
            raise TypeError("give either an epoch or epochs=N")
        if epoch is not None and epoch > self.sampler.epoch:
            raise ValueError(f"epoch {epoch} asked for while epoch {self.sampler.epoch} is not finished")
        end = epochs if epochs is not None else (epoch or 0) + 1
        plan = self.policy.step_plan(self.world_size)
        while self.sampler.epoch < end and not self._stopped:
            total = self.sampler.step_size(plan.global_batch)
            mine = self.sampler.step_indices(plan.global_batch)
            offset = 0
            for j, size in enumerate(split_sizes(len(mine), plan.accumulation_steps)):
                last = j == plan.accumulation_steps - 1
                with nullcontext() if last else self.model.no_sync():
                    idx = mine[offset : offset + size]
                    offset += size
                    if size == 0:
                        self._zero_backward()
                        continue
                    self._scale = size * self.world_size / total  # exact mean over the global batch
                    self._backward_done = False
                    yield self._batch(idx)
                    if not self._backward_done:
                        raise RuntimeError("trainer.backward(loss) must be called once for every batch")
            self._finish_step(mine)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the mean loss over the micro-batch just yielded (scaled for exact averaging)."""
        (loss * self._scale).backward()
        self._backward_done = True
        self._loss_sum += float(loss.detach()) * self._scale
        self._loss_count += 1

    def _batch(self, idx: Sequence[int]) -> Any:
        batch = self._collate([self._dataset[i] for i in idx])
        return _to_device(batch, self.device)

    def _zero_backward(self) -> None:
        # A rank with no samples in this micro-batch still joins DDP's all-reduce, with zero gradients.
        params = [p for p in self.model.parameters() if p.requires_grad]
        torch.stack([p.sum() for p in params]).sum().mul(0.0).backward()

    def _arm_stop_timeout(self, sig: signal.Signals) -> None:
        """Runs in the watcher's thread as soon as SIGTERM arrives (also while the main thread is blocked)."""
        if self.config.stop_timeout is None:
            return
        limit = max(self.config.stop_timeout.total_seconds(), 3 * max(self._step_times, default=0.0))

        def watchdog() -> None:
            if self._boundary_after_signal.wait(limit):
                return
            logger.error(
                "%s %.0f s ago and step %d's boundary not reached: blocked in a collective with a vanished peer?"
                " exiting without the final save", sig.name, limit, self.step,
            )  # fmt: skip
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(128 + int(sig))

        threading.Thread(target=watchdog, name="stop-timeout", daemon=True).start()

    def _finish_step(self, indices: Sequence[int]) -> None:
        now = time.monotonic()
        if self._last_boundary is not None:
            self._step_times.append(now - self._last_boundary)
        self._last_boundary = now
        plan = self.policy.step_plan(self.world_size)
        lr = self.current_lr()
        with scaled_lr(self.optimizer, self.lr_factor):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        epoch = self.sampler.epoch
        epoch_done = self.sampler.advance(plan.global_batch)
        self.step += 1
        loss = self._loss_sum if self._loss_count else None
        self._loss_sum, self._loss_count = 0.0, 0
        if self._on_step is not None:
            self._on_step(StepInfo(self.step, epoch, self.rank, self.world_size, list(indices), lr, loss))
        self._maybe_report(lr, loss)
        self._maybe_save(epoch_done)
        self._publish_progress(lr, loss)

    def _round_nodes(self) -> list[str] | None:
        """The service's names of this round's nodes (one all-gather per start), or None outside the service.

        The job service sets ``ETRAIN_NODE_NAME`` for every worker of a job, so every rank takes part."""
        job = WorkerEnv.from_environ().job
        if job is None:
            return None
        name = job.node_name
        names: list[Any] = [None] * self.world_size
        dist.all_gather_object(names, name)
        return sorted({str(n) for n in names})

    def _maybe_report(self, lr: float, loss: float | None) -> None:
        every = self.config.progress_every
        if every <= 0 or self.step % every != 0:
            return
        mean = self.average({"loss": loss if loss is not None else 0.0})["loss"]
        if self.rank == 0:
            logger.info(
                "step %d epoch %d loss %.5f world %d lr %.6g", self.step, self.sampler.epoch, mean, self.world_size, lr
            )

    def _publish_progress(self, lr: float, loss: float | None) -> None:
        """Progress for the job service (rank 0 only, throttled by the reporter; a no-op elsewhere)."""
        committed: dict[str, Any] = {}
        pending = self._pending_checkpoint
        if pending is not None and self._manager is not None and not self._manager.in_flight:
            self._pending_checkpoint = None
            # a failed save is not reported as committed (rank 0 not writing replicated state: it cannot know)
            if self._manager.last_committed_step == pending or not self._manager.is_writer:
                committed = {"checkpoint_step": pending, "checkpoint_path": f"{self._manager.url}/{step_dir(pending)}"}
        self._progress.report(
            self.step, world_size=self.world_size, loss=loss, total_steps=self.config.total_steps,
            lr=lr, epoch=self.sampler.epoch, force=bool(committed), **committed,
            **self.snapshot_stats.progress_fields(),
        )  # fmt: skip

    def average(self, values: dict[str, float]) -> dict[str, float]:
        """Mean of each value over all workers (one all-reduce); a collective: every rank must call it."""
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    # -- checkpoints ---------------------------------------------------------------------------------
    def _maybe_save(self, epoch_done: bool = False) -> None:
        # Every rank, every step: agree on a time-based save, a SIGTERM seen by any rank, a node-local snapshot
        # and whether any rank's checkpoint writer is still busy (non-writers report 0). Doing this collective
        # unconditionally keeps all ranks' collectives in the same order, and their snapshot decisions equal.
        now = time.monotonic()
        signalled = self._preemption.requested
        local_due = self.rank == 0 and self._tiers.want_local(self.step)  # rank 0's measurements decide
        busy = self._manager is not None and self._manager.in_flight
        mine = [self._schedule.time_due(now), signalled, local_due, busy]
        flags = torch.tensor([int(f) for f in mine], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        time_due, anyone_signalled, local, busy = (bool(f) for f in flags.tolist())
        if anyone_signalled:
            # SIGTERM: a preemption notice, or torchrun restarting the group (it signals workers first).
            # Everyone saves this step synchronously (no step is lost); the signalled ranks then exit,
            # the others carry on and resume from this snapshot when the group re-forms.
            self._boundary_after_signal.set()
            logger.warning("SIGTERM seen by a worker: saving step %d synchronously", self.step)
            self.save(blocking=True)
            if signalled:
                self._stopped = True
                if self._manager is not None:
                    self._manager.close()
                raise SystemExit(143)
            return
        self._schedule, decision = self._schedule.decide(Boundary(self.step, now, epoch_done, time_due, busy))
        if decision.warning is not None and self.rank == 0:
            logger.warning("%s", decision.warning)
        if not decision.take and (decision.deferred or decision.skipped):
            logger.debug("snapshot due at step %d %s: the writer is still saving step %s", self.step,
                         "deferred" if decision.deferred else "merged into the pending one (skipped)",
                         self._schedule.stats.last_saved_step)  # fmt: skip
        if decision.take:
            self.save(blocking=False)
            self._tiers.note_durable(self.step)
        elif local:
            self._tiers.save_local(self.step, self._capture, overlap_with=self.optimizer)

    def _capture(self) -> TrainingState:
        """References to the full state (a collective: gathers every rank's RNG state)."""
        return capture_training_state(
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            data_cursor={"sampler": self.sampler.state_dict()},
            lr_reference=self.policy.reference(),
            extras={"lr_ramp": dataclasses.asdict(self._ramp)},
            world_size=self.world_size,
        )

    def save(self, blocking: bool = False) -> None:
        """Snapshot the full state now (a collective: every rank must call it)."""
        if self._manager is None:
            return
        state = self._capture()
        # The optimizer's tensors are copied by the writer thread while the next forward/backward runs;
        # the next optimizer.step() waits for that copy (see CheckpointManager.save).
        overlap = None if blocking else self.optimizer
        try:
            self._manager.save(self.step, state, blocking=blocking, overlap_with=overlap)
            self._failing_since = None  # the previous save (if any) committed: the manager raises its failure here
        except CheckpointFencedError:
            raise  # this generation has been replaced: stop, never write again
        except CheckpointWriteError as exc:
            # The previous background save failed (or this blocking one). Committed snapshots are intact, so
            # training goes on and this step is saved instead, until saves have failed for save_failure_grace.
            now = time.monotonic()
            self._failing_since = self._failing_since if self._failing_since is not None else now
            failing = now - self._failing_since
            if failing > self.config.save_failure_grace.total_seconds():
                raise
            grace = self.config.save_failure_grace.total_seconds()
            logger.warning("checkpoint save failed (failing for %.0f s, giving up after %.0f s): %s; saving step %d "
                           "instead", failing, grace, exc, self.step)  # fmt: skip
            if blocking:
                self._manager.save(self.step, state, blocking=True)  # its failure stops the worker
            else:
                self._manager.save(self.step, state, blocking=False, overlap_with=overlap)
        self._schedule = self._schedule.started(self.step, time.monotonic(), background=not blocking)
        self._pending_checkpoint = self.step

    @property
    def snapshot_stats(self) -> SnapshotStats:
        """Durable snapshots saved, deferred (writer busy) and skipped so far (the same on every rank)."""
        return self._schedule.stats

    @property
    def resumed_from(self) -> str | None:
        """Which tier the start-up restore used: ``"durable"``, ``"node-local"``, or None (a fresh start)."""
        return self._tiers.source

    @property
    def stopped_by_preemption(self) -> bool:
        return self._stopped

    def close(self, finished: bool = True) -> None:
        """Flush the in-flight save (raising its error) and leave the process group. ``finished``: the job
        is done, so this node's in-memory snapshots are deleted (kept after a preemption stop), and a deferred
        snapshot still pending is taken now, synchronously, of the state at this call (a collective then)."""
        pending = self._schedule.stats.pending_since
        if finished and not self._stopped and pending is not None and self._manager is not None:
            logger.info("taking the snapshot pending since step %d at step %d before closing", pending, self.step)
            self.save(blocking=True)
        self._boundary_after_signal.set()
        self._preemption.uninstall()
        self._tiers.close(finished=finished and not self._stopped)
        if self._manager is not None:
            self._manager.close()
        if self._pending_checkpoint is not None and self._manager is not None:
            self._publish_progress(self.current_lr(), None)
        self._progress.close()
        if dist.is_initialized():
            dist.barrier()
            # gloo's worker thread frees finished work (which holds Python tensors) under the GIL; give it
            # the GIL now, or tearing the group down from the main thread can deadlock at exit.
            time.sleep(0.2)
            compat.destroy_process_group()

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(finished=exc[0] is None)


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
