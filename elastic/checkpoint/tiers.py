"""Two tiers of snapshots: durable ones on shared storage, and node-local ones in memory (``/dev/shm``).

A durable snapshot every N steps survives losing every node; a node-local snapshot every step (or every
few) bounds what a single failure costs. After a worker crash or the loss of a node, the re-formed group
resumes from the newest step that *any* surviving node still holds in its local tier, so about
``local_every_steps`` steps at most are re-done instead of up to ``save_every_steps`` (more when the cost cap
spaces snapshots out, see ``want_local``).

Contract of :class:`SnapshotTiers` (replicated, DDP-style state only: any node's copy is the whole state):

- ``restore()`` is a collective (every rank calls it, in the same order as other collectives):
  1. rank 0 picks the newest durable snapshot that verifies (as with durable snapshots alone);
  2. the first worker of each node reports the newest committed step of every slot on its node;
  3. if the newest local step is newer than the durable one, the lowest rank holding it loads and
     verifies it and broadcasts the state to every rank; if it does not verify, every rank falls back to
     the durable snapshot, with a warning. It returns the :class:`TrainingState` to resume from, or None.
- ``save_local()`` is a collective (it captures the state) and a best effort: the first worker of each
  node writes asynchronously to its own slot; a save still in flight is not waited for (that step is
  skipped), and a failed local write is a warning, never an error of the training run.
- ``want_local()`` spaces snapshots: every ``local_every_steps``, and with ``max_overhead`` no more often
  than keeps their measured cost under that fraction of the time (so fast steps get one every few steps).
- Slots (``slot-<k>``, :mod:`elastic.checkpoint.slots`): each writer holds an exclusive ``flock`` on its slot
  for its lifetime, so two agents on one host never write the same directory, and a restarted worker finds
  what its dead predecessor wrote. After a restore, the data of slots nobody holds is deleted (it is no newer
  than what was restored).
- ``close(finished=True)`` deletes this node's local tier (the job is done: nothing is left in memory).
- What a worker SIGKILLed or a node lost whole leaves in memory is deleted by the next worker to start on the node
  once the processes that owned it are gone (:mod:`elastic.checkpoint.owners`: the writer claims the job's directory
  and records its launcher; ``create_snapshot_tiers`` sweeps the other jobs' directories).
- Logging: a snapshot's lines (its commit, the retention of the one before) are DEBUG, as are the local managers'
  other INFO lines (:mod:`elastic.checkpoint.quiet_logs`); warnings and the resume's line are as for durable ones.
- Privacy: the tier's directory is a private one (:func:`elastic.runtime_dir.private_dir`: created 0700,
  owned by us, no symlink, nothing above it that another user controls) and its files are written 0600. A
  directory that fails those checks (e.g. ``/dev/shm/etrain-<uid>`` pre-created by another user, who could
  plant a slot with a huge step there) turns the local tier off on that node, with a warning naming the
  path, its owner and mode; training goes on with durable snapshots.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.api import CheckpointError, CheckpointManager
from elastic.checkpoint.base import StorageCheckpointManager
from elastic.checkpoint.owners import JobDirClaim, claim_job_dir, sweep
from elastic.checkpoint.quiet_logs import quiet, unquiet
from elastic.checkpoint.slots import MAX_SLOTS, SlotClaim, claim_slot, is_held, slot_dirs
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import BinaryWriter, LocalStorage
from elastic.contract.env import LOCAL_SNAPSHOT_DIR, TorchrunEnv, WorkerEnv
from elastic.contract.progress import LOCAL_SNAPSHOTS_FAILED, LOCAL_SNAPSHOTS_SAVED, LOCAL_SNAPSHOTS_SKIPPED

logger = logging.getLogger(__name__)

__all__ = [
    "LOCAL_OPTIONS",
    "LocalSnapshotStats",
    "LocalSpacing",
    "PrivateStorage",
    "SnapshotTiers",
    "create_snapshot_tiers",
    "default_local_root",
    "local_tier_dir",
]

LOCAL_OPTIONS = CheckpointOptions(keep_last=1, per_node=True, verify_after_write=False, lustre_striping=False)
_SLOT_PREFIX = "slot-"


def default_local_root() -> Path:
    """``$ETRAIN_LOCAL_SNAPSHOT_DIR``, else ``/dev/shm/etrain-<uid>`` (memory), else the temp directory. A local
    tier below it is used only if it is private (see the module docstring)."""
    configured = os.environ.get(LOCAL_SNAPSHOT_DIR)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"etrain-{os.getuid()}"


class PrivateStorage(LocalStorage):
    """:class:`LocalStorage` whose files are 0600 and directories 0700 whatever the umask (all of it lives in
    a private directory already: this keeps a copy or a loosened parent from exposing the state)."""

    def _makedirs(self, path: Path) -> None:
        missing = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        super()._makedirs(path)
        for directory in missing:
            os.chmod(directory, 0o700)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[BinaryWriter]:
        with super().open_write(rel) as out:
            os.chmod(self._path(rel), 0o600)  # before the first byte is written
            yield out


def local_tier_dir(root: Path, durable_url: str | None, job_id: str | None) -> Path:
    """One job's local tier, keyed by its durable checkpoint URL and the job's identity (the service's job
    id, which outlives torchrun generations, else torchrun's run id): a new job that reuses a checkpoint
    URL never resumes from what an earlier job left in memory."""
    key = f"{durable_url or ''}|{job_id or ''}"
    return root / hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LocalSnapshotStats:
    """What became of this rank's node-local snapshots that fell due (the replicated tier: counted by the first
    worker of each node, its writer, and zero elsewhere; the sharded tier: by every rank). ``saved``: writes
    started; ``skipped``: due while this rank's previous one was still being written (a best effort: not waited
    for, so a failure may re-do more than ``local_every_steps``); ``failed``: saves that raised (a background write's
    failure is raised by the next save, which is then not taken either)."""

    saved: int = 0
    skipped: int = 0
    failed: int = 0
    last_skipped_step: int | None = None

    def progress_fields(self) -> dict[str, Any]:
        """Flat JSON-able fields for the job service's progress report (rank 0's node)."""
        return {
            LOCAL_SNAPSHOTS_SAVED: self.saved,
            LOCAL_SNAPSHOTS_SKIPPED: self.skipped,
            LOCAL_SNAPSHOTS_FAILED: self.failed,
        }


class LocalSpacing:
    """When a node-local snapshot is due (this tier's and the sharded one's, elastic/train/shard_tier.py):
    ``every`` steps since the last snapshot (a durable one counts), and, with ``max_overhead``, enough time since
    the last one that its measured cost (the loop blocked in capture and copy, plus the writer's time) stays under
    that fraction of the time between them. :meth:`write` starts one, or skips it while the last is still being
    written, and keeps the counts (:attr:`stats`)."""

    def __init__(self, every: int | None, max_overhead: float | None) -> None:
        self.every, self.max_overhead = every, max_overhead
        self.last_step = 0
        self.last_started: float | None = None
        self.blocking_s = 0.0
        self.stats = LocalSnapshotStats()

    def may_be_due(self, step: int) -> bool:
        """Whether a snapshot can be due at ``step`` (:meth:`due` without its measured cost: the same on every rank,
        whose :attr:`last_step` follows the agreed snapshots)."""
        return self.every is not None and step - self.last_step >= self.every

    def due(self, step: int, writer: Any) -> bool:
        """``writer``: the local manager's ``last_timings`` (None: not known yet)."""
        if self.every is None or step - self.last_step < self.every:
            return False
        if self.max_overhead is None or self.last_started is None:
            return True
        writer_s = writer.data_s + writer.commit_s + writer.verify_s + writer.cleanup_s if writer else 0.0
        return time.monotonic() - self.last_started >= (self.blocking_s + writer_s) / self.max_overhead

    def started(self, step: int) -> None:
        self.last_started, self.last_step = time.monotonic(), step

    def write(
        self, manager: CheckpointManager | None, step: int, save: Callable[[CheckpointManager], None], what: str
    ) -> None:
        """Step ``step``'s snapshot through ``save(manager)`` into ``manager`` (None: this rank writes none), unless the
        manager's last one is still being written: that one is skipped, counted, and logged at the 1st, 2nd, 4th,
        8th, ... skip. A :class:`CheckpointError` is counted, and a warning the first time (``what``: the tier)."""
        if manager is None:
            return
        stats = self.stats
        if manager.in_flight:
            self.stats = replace(stats, skipped=stats.skipped + 1, last_skipped_step=step)
            n = self.stats.skipped
            if n & (n - 1) == 0:
                logger.warning(
                    "%s: step %d skipped, the previous one still being written (%d skipped, %d written "
                    "so far): writes take longer than local_every_steps=%s steps, so a failure may re-do "
                    "more",
                    what,
                    step,
                    n,
                    stats.saved,
                    self.every,
                )
            return
        try:
            save(manager)
        except CheckpointError as exc:
            self.stats = replace(stats, failed=stats.failed + 1)
            if not stats.failed:
                logger.warning("%s failing (durable ones go on): %s", what, exc)
            return
        self.stats = replace(stats, saved=stats.saved + 1)


class SnapshotTiers:
    """See the module docstring. ``durable`` or ``local_dir`` may be None (that tier is off)."""

    def __init__(
        self,
        durable: CheckpointManager | None,
        local_dir: Path | None,
        local_every_steps: int | None,
        device: torch.device,
        max_overhead: float | None = None,
    ) -> None:
        if local_dir is not None and (local_every_steps is None or local_every_steps < 1):
            raise ValueError(f"local_every_steps must be >= 1 with a local tier, got {local_every_steps}")
        self.durable = durable
        self._dir = local_dir
        self._spacing = LocalSpacing(local_every_steps, max_overhead)
        self._device = device
        self._writer = local_dir is not None and TorchrunEnv.from_environ().local_rank == 0
        self._claim: SlotClaim | None = None
        self._job_claim: JobDirClaim | None = None
        self._local: StorageCheckpointManager | None = None
        self.source: str | None = None  # what the last restore resumed from: "node-local", "durable" or None
        # node-local snapshots are signed like the durable ones: a slot another user or job planted is skipped
        key = durable.options.signing_key if durable is not None else WorkerEnv.from_environ().checkpoint_key
        self._options = replace(LOCAL_OPTIONS, signing_key=key)
        if self._writer:
            assert local_dir is not None
            try:
                slot = self._claim_slot(local_dir)
            except OSError as exc:  # refused as unsafe (UnsafeDirectoryError), or not creatable
                logger.warning("node-local snapshots off on this node (durable ones go on): %s", exc)
                self._dir, self._writer = None, False
            else:
                storage = PrivateStorage(slot, url=str(slot))
                quiet(storage.url)  # a line per snapshot: DEBUG
                self._local = create_checkpoint_manager(str(slot), self._options, storage=storage)
                self._local.check_storage()

    # -- slots ---------------------------------------------------------------------------------------
    def _claim_slot(self, root: Path) -> Path:
        self._job_claim = claim_job_dir(root)  # private, and ours until close (elastic.checkpoint.owners)
        claim = claim_slot(root, _SLOT_PREFIX)
        if claim is None:
            raise CheckpointError(f"all {MAX_SLOTS} local snapshot slots under {root} are held")
        self._claim = claim
        return claim.path

    def _slots(self) -> list[Path]:
        assert self._dir is not None
        return slot_dirs(self._dir, _SLOT_PREFIX)

    def _newest_local(self) -> tuple[int, Path | None]:
        best: tuple[int, Path | None] = (-1, None)
        for slot in self._slots():
            with create_checkpoint_manager(str(slot), self._options) as reader:
                step = reader.latest_step()
            if step is not None and step > best[0]:
                best = (step, slot)
        return best

    def _drop_stale_slots(self) -> None:
        mine = Path(self._local.url) if self._local is not None else None
        for slot in self._slots():
            if slot != mine and not is_held(slot):
                shutil.rmtree(slot, ignore_errors=True)

    # -- restore -------------------------------------------------------------------------------------
    def restore(self) -> TrainingState | None:
        rank, world = dist.get_rank(), dist.get_world_size()
        durable_latest = self.durable.latest_step() if self.durable is not None and rank == 0 else None
        local_step, local_slot = self._newest_local() if self._writer else (-1, None)
        mine = torch.tensor([-1 if durable_latest is None else durable_latest, local_step], device=self._device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        local_steps = [int(g[1]) for g in gathered]
        best = max(local_steps)
        src = local_steps.index(best)
        tried = best > int(gathered[0][0])
        state = self._broadcast_local(src, best, local_slot) if tried else None
        self.source = "node-local" if state is not None else None
        if state is None:
            state = self._restore_durable(rank)
            self.source = "durable" if state is not None else None
            if not tried and best >= 0 and (state is None or best > state.step):  # newest durable ones corrupt
                local = self._broadcast_local(src, best, local_slot)
                if local is not None:
                    state, self.source = local, "node-local"
        if self._writer:
            self._drop_stale_slots()
        return state

    def _restore_durable(self, rank: int) -> TrainingState | None:
        """Rank 0 picks the newest durable snapshot that verifies, so every rank loads the same one."""
        if self.durable is None:
            return None
        # straight into this rank's device (parallel reads through pinned buffers on CUDA)
        snapshot = self.durable.load_latest(device=self._device) if rank == 0 else None
        chosen = torch.tensor([-1 if snapshot is None else snapshot.step], device=self._device)
        dist.broadcast(chosen, 0)
        step = int(chosen.item())
        if step < 0:
            return None
        return (snapshot if snapshot is not None else self.durable.load(step, device=self._device)).training_state()

    def _broadcast_local(self, src: int, step: int, slot: Path | None) -> TrainingState | None:
        payload: list[Any] = [None]
        if dist.get_rank() == src:
            assert slot is not None
            try:
                with create_checkpoint_manager(str(slot), self._options) as reader:
                    payload[0] = reader.load(step).state
            except CheckpointError as exc:
                logger.warning("node-local snapshot step %d is unusable (%s); using a durable one", step, exc)
        dist.broadcast_object_list(payload, src=src, device=self._device)
        if payload[0] is None:
            return None
        logger.info("resuming from node-local snapshot step %d (held by rank %d)", step, src)
        return TrainingState.from_dict(payload[0])

    # -- save ----------------------------------------------------------------------------------------
    def want_local(self, step: int) -> bool:
        """Whether a node-local snapshot is due at ``step`` on this rank's measurements (the loop takes rank
        0's answer for every rank): ``local_every_steps`` since the last snapshot, and, with
        ``max_overhead``, enough time since the last one that its measured cost (the loop blocked in
        capture and copy, plus the writer's time) stays under that fraction of the time between them."""
        return self._dir is not None and self._spacing.due(step, self._local.last_timings if self._local else None)

    def may_want_local(self, step: int) -> bool:
        """Whether :meth:`want_local` can be True at ``step`` on rank 0 (known to every rank: the loop agrees on the
        flags of such a step)."""
        return self._spacing.may_be_due(step)

    def note_durable(self, step: int) -> None:
        """A durable snapshot was taken at ``step``: the next local one is counted from there."""
        self._spacing.last_step = step

    @property
    def in_flight(self) -> bool:
        """Whether this rank's last local snapshot is still being written (one due now would be skipped)."""
        return self._local is not None and self._local.in_flight

    @property
    def local_stats(self) -> LocalSnapshotStats:
        """This rank's node-local snapshots written, skipped (writer busy) and failed so far."""
        return self._spacing.stats

    def prepare(self, state: TrainingState) -> None:
        """Have the local tier's manager warm its staging buffers up for ``state`` (see
        ``CheckpointManager.prepare``); nothing when this rank writes no local snapshots."""
        if self._local is not None and self._spacing.every is not None:
            self._local.prepare(state)

    def save_local(
        self,
        step: int,
        capture: Callable[[], TrainingState | Mapping[str, Any]],
        overlap_with: torch.optim.Optimizer | None,
    ) -> None:
        """Take a node-local snapshot (a collective: ``capture`` gathers every rank's RNG state)."""
        started = time.perf_counter()
        self._spacing.started(step)
        state = capture()
        # self._local is None on the ranks that are not their node's writer: nothing written, nothing counted
        self._spacing.write(
            self._local, step, lambda local: local.save(step, state, overlap_with=overlap_with), "node-local snapshots"
        )
        self._spacing.blocking_s = time.perf_counter() - started

    def close(self, finished: bool = False) -> None:
        """Flush the local tier; with ``finished`` (the job is done) delete this node's local snapshots."""
        if self._local is not None:
            try:
                self._local.close()
            except CheckpointError as exc:
                logger.warning("last node-local snapshot failed: %s", exc)
            unquiet(self._local.url)
            self._local = None
        if finished and self._writer and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        if self._job_claim is not None:
            self._job_claim.release()
            self._job_claim = None


def create_snapshot_tiers(
    durable: CheckpointManager | None,
    local_every_steps: int | None,
    device: torch.device,
    max_overhead: float | None = None,
) -> SnapshotTiers:
    """Tiers for a worker started by torchrun; the local tier is on when ``local_every_steps`` is set. The first
    worker of each node then deletes what other jobs' owners that are gone left in memory (see the module
    docstring), whether or not its own tier is on."""
    local_dir = None
    root = default_local_root()
    if local_every_steps is not None:
        job_id = WorkerEnv.from_environ().job_id or TorchrunEnv.from_environ().run_id
        local_dir = local_tier_dir(root, durable.url if durable is not None else None, job_id)
    tiers = SnapshotTiers(durable, local_dir, local_every_steps, device, max_overhead)
    if TorchrunEnv.from_environ().local_rank == 0:
        sweep(root, keep=local_dir)
    return tiers
