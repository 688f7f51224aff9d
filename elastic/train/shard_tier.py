"""Node-local snapshots of a sharded model (``parallelize=``): every rank keeps its own shard in memory.

The replicated tier (:mod:`elastic.checkpoint.tiers`) has one writer per node, whose copy is the whole state. Here
every rank writes its shard (parameters, buffers, optimizer state: :meth:`ShardedModel.local_payload`) and the
loop's state to a slot of its own on its node, under the same private directory, file modes and signing key as
the replicated tier. A slot is named after the shard it holds, ``n<shard_size>-i<shard_index>-<k>`` (``k``: the
first one free; each writer holds an exclusive ``flock`` on its slot for its lifetime, as
:mod:`elastic.checkpoint.slots` claims them).

:meth:`ShardTier.restore` is a collective, run before the durable restore: every rank finds, among its node's
slots, the newest snapshot of the shard it holds in the new world; the newest step any rank has is used when it is
newer than the newest durable snapshot and every shard index has a rank holding it at that step
(:func:`~elastic.train.parallel.shard_sources`). Those ranks load and verify theirs and send each shard over its
replicate group to the others (:func:`~elastic.train.parallel.share_shards`). Otherwise, or when a load fails
anywhere, the caller restores the durable snapshot (DCP reshards it). A save is a best effort, as in the
replicated tier: a slot still writing skips that step, a failed write is a warning. As there, each writer claims the
job's directory (:mod:`elastic.checkpoint.owners`: what it leaves when SIGKILLed is deleted once its owners are
gone) and a snapshot's lines are DEBUG (:mod:`elastic.checkpoint.quiet_logs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint import create_checkpoint_manager
from elastic.checkpoint.api import CheckpointError
from elastic.checkpoint.manager import FsspecCheckpointManager
from elastic.checkpoint.owners import OWNERS, JobDirClaim, claim_job_dir
from elastic.checkpoint.quiet_logs import quiet, unquiet
from elastic.checkpoint.slots import MAX_SLOTS, SlotClaim, claim_slot, slot_dirs
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.tiers import (
    LOCAL_OPTIONS,
    LocalSnapshotStats,
    LocalSpacing,
    PrivateStorage,
    default_local_root,
    local_tier_dir,
)
from elastic.contract.env import TorchrunEnv, WorkerEnv
from elastic.runtime_dir import private_dir
from elastic.train.parallel import ShardedModel, shard_sources, share_shards

logger = logging.getLogger(__name__)

__all__ = ["ShardTier", "create_shard_tier"]


class _SlotManager(FsspecCheckpointManager):
    """A manager of one rank's own slot: it writes whatever this rank's rank or local rank (a slot holds one shard,
    written by the rank that holds it)."""

    @property
    def is_writer(self) -> bool:
        return True


class ShardTier:
    """See the module docstring. ``local_dir`` None: off (restore finds nothing, saves do nothing)."""

    def __init__(
        self,
        sharded: ShardedModel,
        local_dir: Path | None,
        every: int | None,
        device: torch.device,
        signing_key: bytes | None = None,
        max_overhead: float | None = None,
    ) -> None:
        if local_dir is not None and (every is None or every < 1):
            raise ValueError(f"local_every_steps must be >= 1 with a local tier, got {every}")
        self._sharded, self._dir, self._device = sharded, local_dir, device
        # two per slot: the step before the newest is still whole where a failure cut the newest's writes short
        self._options = replace(LOCAL_OPTIONS, keep_last=2, signing_key=signing_key)
        self._spacing = LocalSpacing(every, max_overhead)
        self._local: FsspecCheckpointManager | None = None
        self._claimed: SlotClaim | None = None
        self._job_claim: JobDirClaim | None = None
        if local_dir is not None:
            try:
                self._job_claim = claim_job_dir(local_dir.parent)  # the job's directory, ours until close
                private_dir(local_dir)
            except OSError as exc:
                logger.warning("node-local shard snapshots off on this node (durable ones go on): %s", exc)
                self._dir = None

    @property
    def enabled(self) -> bool:
        return self._dir is not None

    # -- slots ---------------------------------------------------------------------------------------
    def _prefix(self) -> str:
        layout = self._sharded.layout
        assert layout is not None, "the model is built for the world first"
        return f"n{layout.shard_size}-i{layout.shard_index}-"

    def _claim(self) -> FsspecCheckpointManager | None:
        """This rank's slot for the shard it holds now (claimed again when the layout changed)."""
        if self._dir is None:
            return None
        prefix = self._prefix()
        if self._claimed is not None and self._claimed.path.name.startswith(prefix):
            return self._local
        self._release()
        claim = claim_slot(self._dir, prefix)
        if claim is None:
            logger.warning("node-local shard snapshots: all %d slots for %s* are held", MAX_SLOTS, prefix)
            return None
        self._claimed, slot = claim, claim.path
        quiet(str(slot))  # a line per snapshot: DEBUG
        self._local = _SlotManager(PrivateStorage(slot, url=str(slot)), self._options)
        return self._local

    def _release(self) -> None:
        if self._local is not None:
            try:
                self._local.close()
            except CheckpointError as exc:
                logger.warning("last node-local shard snapshot failed: %s", exc)
            unquiet(self._local.url)
            self._local = None
        if self._claimed is not None:
            self._claimed.release()
            self._claimed = None

    def _available(self) -> dict[int, Path]:
        """Every committed step among this node's slots of the shard this rank holds now, and a slot holding it."""
        found: dict[int, Path] = {}
        if self._dir is None:
            return found
        for slot in slot_dirs(self._dir, self._prefix()):
            try:
                with create_checkpoint_manager(str(slot), self._options) as reader:
                    steps = [info.step for info in reader.list_snapshots()]
            except CheckpointError as exc:
                logger.warning("node-local shard slot %s unreadable: %s", slot, exc)
                continue
            for step in steps:
                found.setdefault(step, slot)
        return found

    # -- restore -------------------------------------------------------------------------------------
    def restore(self, durable_step: int) -> TrainingState | None:
        """The loop's state of the newest node-local step newer than ``durable_step`` (-1: none) that every shard
        index has, with this rank's shard set from it; None: restore the durable snapshot (a collective).

        Each slot keeps its last two snapshots: a failure can interrupt some ranks' writes of the newest step, and
        the step before is then the newest that every shard has."""
        rank, world = dist.get_rank(), dist.get_world_size()
        available = self._available()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, sorted(available))
        plan, best = None, -1
        for step in sorted({s for steps in gathered for s in steps if s > durable_step}, reverse=True):
            held = [step in steps for steps in gathered]
            plan = shard_sources([step if h else -1 for h in held], held, step, self._sharded.shard_size)
            if plan is not None:
                best = step
                break
        if plan is None:
            if any(gathered):
                logger.info(
                    "no node-local shard snapshot newer than the durable step %d covers every shard; using "
                    "a durable one",
                    durable_step,
                )
            return None
        source = plan.sources[rank % self._sharded.shard_size]
        loop: dict[str, Any] | None = None
        failed = torch.zeros(1, device=self._device)
        if rank == source:
            slot = available[best]
            try:
                with create_checkpoint_manager(str(slot), self._options) as reader:
                    saved = reader.load(best).state
                self._sharded.apply_payload(saved["shards"])
                loop = dict(saved["loop"])
            except (CheckpointError, KeyError, ValueError) as exc:
                logger.warning("node-local shard snapshot step %d in %s is unusable (%s)", best, slot, exc)
                failed.fill_(1)
        dist.all_reduce(failed)
        if failed.item():
            logger.warning("node-local shard snapshots of step %d unusable on some rank; using a durable one", best)
            return None
        received = share_shards(self._sharded, plan, rank, self._device, loop, needed_only=False)
        assert received is not None  # every group sends (needed_only=False), with the source's loop state
        logger.info("resuming from node-local shard snapshots of step %d (shard from rank %d)", best, source)
        return TrainingState.from_dict(received)

    # -- save ----------------------------------------------------------------------------------------
    def want_local(self, step: int) -> bool:
        """As the replicated tier's (:class:`~elastic.checkpoint.tiers.LocalSpacing`)."""
        return self._dir is not None and self._spacing.due(step, self._local.last_timings if self._local else None)

    def may_want_local(self, step: int) -> bool:
        """As the replicated tier's."""
        return self._spacing.may_be_due(step)

    def note_durable(self, step: int) -> None:
        self._spacing.last_step = step

    @property
    def in_flight(self) -> bool:
        """As the replicated tier's: this rank's last shard snapshot is still being written."""
        return self._local is not None and self._local.in_flight

    @property
    def local_stats(self) -> LocalSnapshotStats:
        """As the replicated tier's: this rank's shard snapshots written, skipped and failed so far."""
        return self._spacing.stats

    def save_local(self, step: int, loop: Callable[[], dict[str, Any]]) -> None:
        """This rank's shard and ``loop()`` (the loop's state, no collective) into its slot: copied before this
        returns (no fence on the optimizer: its parameters are DTensors), written in the background."""
        started = time.perf_counter()
        self._spacing.started(step)
        self._spacing.write(
            self._claim(),
            step,
            lambda local: local.save(step, {"loop": loop(), "shards": self._sharded.local_payload()}),
            "node-local shard snapshots",
        )
        self._spacing.blocking_s = time.perf_counter() - started

    def close(self, finished: bool = False) -> None:
        """Flush this rank's slot; ``finished`` (the job is done; a collective): once every rank flushed, delete the
        job's local tier on this node."""
        self._release()
        if self._job_claim is not None:
            self._job_claim.release()
            self._job_claim = None
        if not finished or self._dir is None:
            return
        if dist.is_initialized():
            dist.barrier()  # no rank still writes its last snapshot into what is deleted
        if TorchrunEnv.from_environ().local_rank == 0:
            shutil.rmtree(self._dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                if set(os.listdir(self._dir.parent)) <= {OWNERS}:  # the job's directory, when nothing else is in it
                    (self._dir.parent / OWNERS).unlink()
                    self._dir.parent.rmdir()


def create_shard_tier(
    sharded: ShardedModel,
    durable_url: str | None,
    every: int | None,
    device: torch.device,
    signing_key: bytes | None,
    max_overhead: float | None,
) -> ShardTier:
    """The tier for a worker started by torchrun: on when ``every`` is set, under the job's local tier directory."""
    local_dir = None
    if every is not None:
        job_id = WorkerEnv.from_environ().job_id or TorchrunEnv.from_environ().run_id
        local_dir = local_tier_dir(default_local_root(), durable_url, job_id) / "shards"
    return ShardTier(sharded, local_dir, every, device, signing_key, max_overhead)
