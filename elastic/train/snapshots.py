"""The elastic loop's snapshots: opening the storage, restoring at start, and the snapshot schedule.

:class:`LoopCheckpoints` is the checkpoint concern of :class:`~elastic.train.trainer.ElasticTrainer`: the durable
manager, the node-local tier, the schedule (``save_every_steps``, ``save_every_seconds``, a busy writer deferring a
snapshot), failures of the storage (a grace time before training stops) and the SIGTERM save. Its step-boundary
decisions use flags that every rank agrees on in the loop's boundary all-reduce (:meth:`local_flags` before it,
:meth:`act` after it; :meth:`flags_needed` says where it must run), so that every rank takes the same snapshots.

For a sharded model (FSDP2, ``sharded=True``) the snapshots use the sharded layout (see
:mod:`elastic.train.sharded`): every rank writes its shards, rank 0 commits the manifest, and a restore loads
this world's shards of the newest snapshot that verifies, whatever world saved it. Its node-local snapshots are
per shard (:mod:`elastic.train.shard_tier`: each rank keeps its own) when the trainer shards the model
(``parallelize=``); for a model the script sharded itself they are off (logged), the durable ones go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint import (
    CheckpointError,
    CheckpointFencedError,
    CheckpointStorageError,
    CheckpointWriteError,
    capture_training_state,
    create_checkpoint_manager,
    restore_training_state,
)
from elastic.checkpoint.api import CheckpointManager, StateLayout
from elastic.checkpoint.layout import step_dir
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.tiers import LocalSnapshotStats, create_snapshot_tiers
from elastic.contract.env import WorkerEnv
from elastic.train.boundary import BoundaryFlags
from elastic.train.config import ElasticConfig
from elastic.train.cursor import TrainingCursor
from elastic.train.parallel import ShardedModel
from elastic.train.preemption import save_on_notice
from elastic.train.schedule import Boundary, SnapshotSchedule, SnapshotStats
from elastic.train.shard_tier import ShardTier, create_shard_tier
from elastic.train.sharded import apply_loaded, forget_optimizer_state, load_template

logger = logging.getLogger(__name__)

__all__ = ["Capture", "LoopCheckpoints"]

#: references to the full state, a collective: a :class:`TrainingState`, or a sharded model's mapping
#: (:func:`elastic.train.sharded.capture_sharded`)
Capture = Callable[[], TrainingState | Mapping[str, Any]]


class LoopCheckpoints:
    """See the module docstring. ``capture`` returns references to the full state (a collective)."""

    def __init__(
        self,
        config: ElasticConfig,
        storage: CheckpointStorage | None,
        device: torch.device,
        require_storage: bool = True,
        sharded: bool = False,
        shards: ShardedModel | None = None,
        loop_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``require_storage``: an unusable storage stops the worker at once (one clear line); else (a live
        joiner takes its state from a peer) it is logged, and saves retry under ``save_failure_grace``.
        ``sharded``: the model is sharded (FSDP2): snapshots in the sharded layout; node-local ones per shard
        when the trainer shards it (``shards``, with ``loop_state``: the loop's state of this rank), else none."""
        self.config = config
        self.sharded = sharded
        self._device = device
        self.manager = self._open(config, storage, require_storage, sharded)
        local_every = config.resolved_local_every_steps()
        self.shard_tier: ShardTier | None = None
        self._loop_state = loop_state
        if sharded and local_every is not None:
            if shards is not None and loop_state is not None:
                key = self.manager.options.signing_key if self.manager is not None else None
                self.shard_tier = create_shard_tier(
                    shards,
                    self.manager.url if self.manager is not None else None,
                    local_every,
                    device,
                    key,
                    config.local_max_overhead,
                )
            else:
                logger.warning(
                    "node-local snapshots are off for a model the script sharded itself: pass the "
                    "unsharded one and parallelize= for node-local shard snapshots; durable sharded "
                    "snapshots go on"
                )
            local_every = None
        self.tiers = create_snapshot_tiers(self.manager, local_every, device, config.local_max_overhead)
        self._sharded_source: str | None = None
        self.schedule = SnapshotSchedule(
            config.save_every_steps, config.save_every_seconds, config.when_writer_busy, clock=time.monotonic()
        )
        self.pending: int | None = None  # a step saved in the background, not reported as committed yet
        self._failing_since: float | None = None  # when saves began to fail (none failing: None)
        self._warmed = False
        self._closed = False

    @staticmethod
    def _open(
        config: ElasticConfig, storage: CheckpointStorage | None, require_storage: bool, sharded: bool
    ) -> CheckpointManager | None:
        url = config.resolved_checkpoint_url() or (storage.url if storage is not None else None)
        if url is None:
            logger.warning("no checkpoint URL: training will not survive a restart")
            return None
        options = config.checkpoint_options
        worker = WorkerEnv.from_environ()
        if options.signing_key is None:  # the job service gives each job a key (elastic.contract.env.CHECKPOINT_KEY)
            options = replace(options, signing_key=worker.checkpoint_key)
        if options.generation is None and worker.job is not None:  # fencing of an old generation's saves
            options = replace(options, generation=worker.job.generation)
        if sharded and options.layout != StateLayout.SHARDED:
            options = replace(options, layout=StateLayout.SHARDED, per_node=False)
        manager = create_checkpoint_manager(url, options, storage=storage)
        try:
            manager.check_storage()  # one clear line, before any training, if the storage is unusable
        except CheckpointStorageError as exc:
            if require_storage:
                raise
            logger.warning("%s; joining anyway (the state comes from a peer; saves retry)", exc)
        return manager

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        cursor: TrainingCursor,
        rank: int,
        world_size: int,
    ) -> bool:
        """Every rank restores the same snapshot: the newest verified durable one that rank 0 picks, or a
        newer node-local one that a surviving node holds (a collective). False: nothing to restore."""
        if self.sharded:
            return self._restore_sharded(model, optimizer, scheduler, cursor, rank, world_size)
        state = self.tiers.restore()
        if state is None:
            return False
        ts = restore_training_state(state, model, optimizer, scheduler)
        cursor.load(ts, rank, world_size)
        logger.info(
            "resumed from step %d (epoch %d, position %d)", cursor.step, cursor.sampler.epoch, cursor.sampler.position
        )
        return True

    def _restore_sharded(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        cursor: TrainingCursor,
        rank: int,
        world_size: int,
    ) -> bool:
        """A sharded model: this node's shard snapshots when they are newer than every durable one and cover every
        shard (:class:`~elastic.train.shard_tier.ShardTier`), else every rank loads its shards of the newest
        durable snapshot that rank 0 verifies (DCP reshards them from whatever world saved it); then the loop's
        state (cursor, RNG, scheduler)."""
        newest = self.manager.latest_step() if rank == 0 and self.manager is not None else None  # manifests only
        box = torch.tensor([-1 if newest is None else newest], device=self._device)
        dist.broadcast(box, 0)
        if self.shard_tier is not None:  # this node's shards, when newer than the newest durable snapshot
            local = self.shard_tier.restore(int(box.item()))
            if local is not None:
                ts = restore_training_state(local, None, None, scheduler)
                cursor.load(ts, rank, world_size)
                self._sharded_source = "node-local"
                logger.info("resumed sharded state from node-local shard snapshots of step %d", cursor.step)
                return True
        if self.manager is None or int(box.item()) < 0:
            return False
        snapshot = self.manager.load_latest(template=load_template(model, optimizer))
        if snapshot is None:  # every snapshot failed verification: a fresh start
            forget_optimizer_state(optimizer)
            return False
        ts = apply_loaded(snapshot.state, model, optimizer, scheduler)
        cursor.load(ts, rank, world_size)
        self._sharded_source = "durable"
        logger.info(
            "resumed sharded state from step %d (saved by %d workers; epoch %d, position %d)",
            cursor.step,
            ts.world_size,
            cursor.sampler.epoch,
            cursor.sampler.position,
        )
        return True

    @property
    def source(self) -> str | None:
        """Which tier the start-up restore used: ``"durable"``, ``"node-local"``, or None (a fresh start)."""
        return self._sharded_source if self.sharded else self.tiers.source

    def warm_up(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, cursor: TrainingCursor
    ) -> None:
        """Once per run, at the first step boundary: have the manager allocate its staging buffers in the
        background (``CheckpointManager.prepare``), so that the first snapshot costs what later ones do.  Not
        earlier: only after a step does the optimizer hold its state (AdamW's moments appear at the first
        step) and does the device's free memory reflect a step's peak (what device-side staging budgets
        from).  The state is captured as a save captures it, but with this rank's RNG state only (no
        collective; the RNG states come after the model's and optimizer's tensors, and are small host ones)."""
        if self._warmed or self.manager is None or self.sharded:  # DCP stages sharded state itself
            return
        self._warmed = True
        state = capture_training_state(cursor.step, model, optimizer, scheduler, gather_rng=False, **cursor.state())
        try:
            self.manager.prepare(state)  # nothing where this rank does not write
            self.tiers.prepare(state)  # the node-local tier's manager, when on here
        except CheckpointError as exc:  # the first save allocates its buffers itself
            logger.warning("checkpoint staging warm-up not started: %s", exc)

    # -- the step boundary -----------------------------------------------------------------------------
    def share_schedule(self) -> Any:
        """The snapshot schedule as a member sends it to a new generation's others (live mode: it decides
        collectives, so every member must hold the same); its clock as an age, since clocks differ between hosts."""
        return self.schedule, time.monotonic() - self.schedule.clock

    def adopt_schedule(self, shared: Any) -> None:
        """Take a member's :meth:`share_schedule`."""
        schedule, age = shared
        self.schedule = replace(schedule, clock=time.monotonic() - age)

    def local_flags(self, step: int, now: float, signalled: bool, rank: int) -> BoundaryFlags:
        """This rank's view of the snapshot flags (see :class:`BoundaryFlags`), before the group agrees; ``step``:
        the boundary they are acted on (a deferred agreement's is the next one)."""
        return BoundaryFlags(
            time_due=self.schedule.time_due(now),
            signalled=signalled,
            local_due=rank == 0 and (self.shard_tier or self.tiers).want_local(step),
            writer_busy=self.manager is not None and self.manager.in_flight,
        )

    def flags_needed(self, step: int, epoch_done: bool) -> bool:
        """Whether a snapshot may be due at the boundary ending ``step`` on a schedule every rank knows, so that the
        ranks must agree on its flags there (:mod:`elastic.train.agreement`): an epoch's end, a multiple of
        ``save_every_steps``, a pending snapshot, a node-local snapshot's earliest step. A time-based snapshot and
        a SIGTERM wait for the next agreement."""
        schedule = self.schedule
        return (
            epoch_done
            or schedule.stats.pending_since is not None
            or (schedule.every_steps is not None and step % schedule.every_steps == 0)
            or (self.shard_tier or self.tiers).may_want_local(step)
        )

    def act(
        self,
        flags: BoundaryFlags | None,
        step: int,
        epoch_done: bool,
        rank: int,
        signalled_here: bool,
        capture: Capture,
        optimizer: torch.optim.Optimizer,
    ) -> bool:
        """Take the snapshots the agreed ``flags`` call for at this boundary (collectives on every rank); None: no
        flags were agreed here (:meth:`flags_needed` was False, so none can be due). Returns whether this rank must
        stop now (it was SIGTERM'd and the step is saved)."""
        if flags is None:
            return False
        if flags.signalled:
            # SIGTERM: a preemption notice, or torchrun restarting the group (it signals workers first).
            # Everyone saves this step synchronously (no step is lost); the signalled ranks then exit,
            # the others carry on and resume from this snapshot when the group re-forms.
            save_on_notice(
                step,
                lambda: self.save(step, capture, optimizer, blocking=True),
                "SIGTERM" if signalled_here else "SIGTERM seen by a peer",
            )
            return signalled_here
        now = time.monotonic()
        boundary = Boundary(step, now, epoch_done, flags.time_due, flags.writer_busy)
        self.schedule, decision = self.schedule.decide(boundary)
        if decision.warning is not None and rank == 0:
            logger.warning("%s", decision.warning)
        if not decision.take and (decision.deferred or decision.skipped):
            logger.debug(
                "snapshot due at step %d %s: the writer is still saving step %s",
                step,
                "deferred" if decision.deferred else "merged into the pending one (skipped)",
                self.schedule.stats.last_saved_step,
            )
        if decision.take:
            self.save(step, capture, optimizer, blocking=False)
            (self.shard_tier or self.tiers).note_durable(step)
        elif flags.local_due and self.shard_tier is not None:
            assert self._loop_state is not None
            self.shard_tier.save_local(step, self._loop_state)
        elif flags.local_due:
            self.tiers.save_local(step, capture, overlap_with=optimizer)
        return False

    def save(self, step: int, capture: Capture, optimizer: torch.optim.Optimizer, blocking: bool) -> None:
        """Snapshot the full state now (a collective: every rank must call it)."""
        if self.manager is None:
            return
        state = capture()
        # The optimizer's tensors are copied by the writer thread while the next forward/backward runs;
        # the next optimizer.step() waits for that copy (see CheckpointManager.save). Sharded state: DCP
        # copies every shard before save returns, and writes in the background.
        overlap = None if blocking or self.sharded else optimizer
        try:
            self.manager.save(step, state, blocking=blocking, overlap_with=overlap)
            self._failing_since = None  # the previous save (if any) committed: the manager raises its failure here
        except CheckpointFencedError:
            raise  # this generation has been replaced: stop, never write again
        except CheckpointWriteError as exc:
            # The previous background save failed (or this blocking one). Committed snapshots are intact, so
            # training goes on and this step is saved instead, until saves have failed for save_failure_grace.
            now = time.monotonic()
            self._failing_since = self._failing_since if self._failing_since is not None else now
            failing = now - self._failing_since
            grace = self.config.save_failure_grace.total_seconds()
            if failing > grace:
                raise
            logger.warning(
                "checkpoint save failed (failing for %.0f s, giving up after %.0f s): %s; saving step %d instead",
                failing,
                grace,
                exc,
                step,
            )
            if blocking:
                self.manager.save(step, state, blocking=True)  # its failure stops the worker
            else:
                self.manager.save(step, state, blocking=False, overlap_with=overlap)
        self.schedule = self.schedule.started(step, time.monotonic(), background=not blocking)
        self.pending = step

    def committed_report(self) -> dict[str, Any]:
        """The checkpoint fields of a progress report once the pending save committed (else empty)."""
        pending = self.pending
        if pending is None or self.manager is None or self.manager.in_flight:
            return {}
        self.pending = None
        # a failed save is not reported as committed (rank 0 not writing replicated state: it cannot know)
        if self.manager.last_committed_step == pending or not self.manager.is_writer:
            return {"checkpoint_step": pending, "checkpoint_path": f"{self.manager.url}/{step_dir(pending)}"}
        return {}

    def before_reform(self, admit: bool) -> None:
        """A live re-form is about to replace the process group, which a sharded save in flight still uses (DCP
        gathers the shards' metadata once their writes are done). ``admit`` (every member is alive and at this
        boundary): wait for that save to commit; a failure of it counts as a failed save (warned about, retried
        at the next one). After a failure (``admit`` False) it cannot finish its collectives: given up, its
        error logged (:meth:`CheckpointManager.abandon`), so that it never fails a later save or the exit."""
        if self.manager is None:
            return
        if not admit:
            self.manager.abandon()
            return
        if not self.sharded:
            return  # replicated saves run no collective in the background
        try:
            self.manager.wait()
        except CheckpointWriteError as exc:
            self._failing_since = self._failing_since if self._failing_since is not None else time.monotonic()
            logger.warning("checkpoint save failed before the re-form that admits new workers: %s", exc)

    @property
    def stats(self) -> SnapshotStats:
        return self.schedule.stats

    @property
    def local_stats(self) -> LocalSnapshotStats:
        """This rank's node-local snapshots written, skipped (its last one still being written) and failed."""
        return (self.shard_tier or self.tiers).local_stats

    @property
    def local_in_flight(self) -> bool:
        """Whether this rank's last node-local snapshot is still being written: one due now is skipped (a best
        effort, see elastic/checkpoint/tiers.py), so a failure may then re-do more than ``local_every_steps``."""
        return (self.shard_tier or self.tiers).in_flight

    def close(self, finished: bool) -> None:
        """Flush the local tier (``finished``: delete this node's local snapshots) and the manager (once)."""
        if self._closed:
            return
        self._closed = True
        self.tiers.close(finished=finished)
        if self.shard_tier is not None:
            self.shard_tier.close(finished=finished)
        if self.manager is not None:
            self.manager.close()
