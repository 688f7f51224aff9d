"""The checkpoint manager over any fsspec URL: background saves, verified loads, retention.

Background saves run in one writer *thread*, not a process.  Measured on 2 cores, the heavy parts of a
save (``os.write``/socket sends, BLAKE3 or SHA-256 over multi-MiB chunks) release the GIL, so a thread
does not hold the training loop back, while a process would need the state shipped through shared memory
and a start-up of its own (and ``spawn`` re-imports the user's training script).  The training thread
blocks only for copying the tensors into reused CPU buffers (see ``Stager``); CUDA tensors are only queued for
copying into reused pinned buffers on a copy stream, and the training stream is ordered after those copies
with CUDA events (GPU-side) instead of the host waiting for them.  With ``overlap_with=optimizer`` the
optimizer's own tensors are copied while the next forward/backward runs, and a pre-step hook (the *fence*)
orders ``optimizer.step()`` after their copy: on CUDA by making the current stream wait for an event, for CPU
tensors (copied by the writer thread) by waiting on the host.  Where device memory allows, CUDA tensors are
first copied into reused device buffers, so that those events mark a device-to-device copy, and drained to the
pinned buffers behind it (see ``device_staging``).  :meth:`FsspecCheckpointManager.prepare` allocates the
buffers in a background thread before the first save.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from elastic.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointManager,
    CheckpointOptions,
    CheckpointWriteError,
    EventHook,
    Snapshot,
    SnapshotInfo,
    StateLayout,
)
from elastic.checkpoint.device_staging import CUDA_MEMORY, DeviceBufferPool, DeviceStagingSettings
from elastic.checkpoint.layout import Manifest, ManifestError, step_dir, writer_rank_for
from elastic.checkpoint.reader import read_manifest, read_pack, scan
from elastic.checkpoint.staging import FlatState, Stager
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import (
    CheckpointStorage,
    StripeSettings,
    create_storage,
    describe_storage_failure,
)
from elastic.checkpoint.warmup import StagingWarmUp
from elastic.checkpoint.writer import PackSaveJob, SaveTimings
from elastic.contract.env import TorchrunEnv

__all__ = ["FsspecCheckpointManager", "create_checkpoint_manager", "current_rank_and_world"]

logger = logging.getLogger(__name__)


def current_rank_and_world() -> tuple[int, int]:
    """(rank, world size) from ``torch.distributed`` if initialized, else ``RANK``/``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    torchrun = TorchrunEnv.from_environ()
    return torchrun.rank, torchrun.world_size


def _optimizer_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """Storage addresses of everything ``optimizer.step()`` writes: its parameters and state tensors."""
    owned = {p.untyped_storage().data_ptr() for group in optimizer.param_groups for p in group["params"]}
    for per_param in optimizer.state.values():
        owned.update(v.untyped_storage().data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    return owned


def _as_mapping(state: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    if isinstance(state, TrainingState):
        return state.to_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping or a TrainingState, got {type(state).__name__}")
    return state


class FsspecCheckpointManager(CheckpointManager):
    """:class:`CheckpointManager` for replicated (pack) and sharded (DCP) state on one storage root."""

    def __init__(
        self, storage: CheckpointStorage, options: CheckpointOptions, events: EventHook | None = None,
        *, stager: Stager | None = None,
    ) -> None:  # fmt: skip
        """``stager`` replaces the one built from ``options`` (tests: in-memory copy streams and device)."""
        self._storage = storage
        self._options = options
        self._events = events
        storage.events = events
        self._stager = stager if stager is not None else _stager_for(options)
        self._warm_up = StagingWarmUp(self._stager)
        self.last_device_staged_bytes = 0  # of the last save: bytes of CUDA tensors staged on their device
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[Manifest] | None = None
        self._last_committed: int | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._said_fresh = False
        self._sharded: Any = None
        self.last_timings = SaveTimings()
        self.last_blocking_s = 0.0
        self.last_fence_wait_s = 0.0
        # the optimizer the last overlapped save deferred copies for, and that save's staged state
        self._fence_target: tuple[weakref.ref[torch.optim.Optimizer], FlatState] | None = None
        self._fences: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        self._exit_hook = _make_exit_hook(weakref.ref(self))
        atexit.register(self._exit_hook)

    # -- identity -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._storage.url

    @property
    def storage(self) -> CheckpointStorage:
        return self._storage

    @property
    def options(self) -> CheckpointOptions:
        return self._options

    @property
    def writer_rank(self) -> int:
        return writer_rank_for(current_rank_and_world()[1], self._options.writer_rank)

    @property
    def is_writer(self) -> bool:
        if self._options.per_node:
            return TorchrunEnv.from_environ().local_rank == 0
        return current_rank_and_world()[0] == self.writer_rank

    def check_storage(self) -> None:
        self._storage.probe()
        logger.info("checkpoint storage %s is usable", self.url)

    # -- saving ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is closed")

    def prepare(self, state: Mapping[str, Any] | Any) -> None:
        """See :class:`CheckpointManager`: a background thread (``checkpoint-warm-up``) allocates the staging
        buffers of ``state``'s tensors once the save in flight (if any) is written; a save waits for it."""
        self._check_open()
        if self._options.layout == StateLayout.SHARDED or not self.is_writer:
            return
        mapping = _as_mapping(state)
        with self._lock:
            self._warm_up.start(mapping, self._future)

    def wait_prepared(self) -> None:
        """Block until the staging warm-up started by :meth:`prepare` (if any) is done (benchmarks, tests)."""
        self._warm_up.join()

    def _warm_up_waited(self, seconds: float) -> None:
        logger.info("checkpoint save waited %.3fs for the staging warm-up to finish", seconds)

    def save(
        self,
        step: int,
        state: Mapping[str, Any] | Any,
        *,
        blocking: bool = False,
        overlap_with: torch.optim.Optimizer | None = None,
    ) -> None:
        """See :class:`CheckpointManager`.  CUDA tensors are queued for copying on a copy stream (see
        ``Stager``): save returns without waiting for the device, and the current stream is ordered after
        the copies.  With ``overlap_with``, tensors sharing storage with the optimizer's parameters or state
        are copied after the others (CUDA: queued last; CPU: by the writer thread), and an optimizer pre-step
        hook orders its next ``step()`` after that copy (CUDA: GPU-side; CPU: the host waits).  Other tensors
        (buffers such as BatchNorm statistics, RNG states, ...) are copied, or ordered before the next
        forward, before returning."""
        self._check_open()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        mapping = _as_mapping(state)
        if self._options.layout == StateLayout.SHARDED:
            if overlap_with is not None:
                raise ValueError("overlap_with applies to the replicated layout (DCP stages sharded state)")
            self._sharded_saver().save(step, mapping, blocking=blocking)
            return
        with self._lock:
            self.wait()
            self._fence_target = None
            if not self.is_writer:
                return
            started = time.perf_counter()
            self._warm_up.join(self._warm_up_waited)  # the warm-up owns the buffers until it is done
            defer = None
            if overlap_with is not None and not blocking:
                self._install_fence(overlap_with)
                owned = _optimizer_storages(overlap_with)

                def defer(t: torch.Tensor) -> bool:
                    return t.numel() > 0 and t.untyped_storage().data_ptr() in owned

            flat = self._stager.flatten(mapping, copy=not blocking, defer=defer)
            self.last_device_staged_bytes = sum(_nbytes(flat.tensors[i]) for i in flat.device_staged)
            if overlap_with is not None and defer is not None:
                self._fence_target = (weakref.ref(overlap_with), flat)
            rank, world = current_rank_and_world()
            job = PackSaveJob(
                storage=self._storage,
                step=step,
                flat=flat,
                options=self._options,
                world_size=world,
                writer_rank=rank,
                events=self._events,
            )
            if blocking:
                self._run_job(job, started)
                self.last_blocking_s = time.perf_counter() - started
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
            try:
                self._future = self._executor.submit(self._run_job, job, started)
            except BaseException:
                flat.staged.set()  # nothing will copy the deferred tensors: do not hold the optimizer
                raise
            self.last_blocking_s = time.perf_counter() - started
            logger.debug("checkpoint step %d staged in %.3fs", step, self.last_blocking_s)

    def _install_fence(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._fences:
            self._fences[optimizer] = optimizer.register_step_pre_hook(self._fence)

    def _fence(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Optimizer pre-step hook: order this step after the deferred copies of the last overlapped save of
        this optimizer's tensors: the current CUDA stream waits for their events (the host does not), and the
        host waits for the writer thread's copies of CPU tensors.  ``last_fence_wait_s``: host time spent."""
        target = self._fence_target
        if target is None or target[0]() is not optimizer:
            return
        mark = time.perf_counter()
        if target[1].fence():
            self.last_fence_wait_s = time.perf_counter() - mark

    def _run_job(self, job: PackSaveJob, started: float) -> Manifest:
        try:
            manifest = job.run()
        except CheckpointFencedError:
            raise  # as it is: the caller must tell "fenced off" from a storage failure
        except CheckpointError as exc:
            raise CheckpointWriteError(f"saving checkpoint step {job.step} to {self.url} failed: {exc}") from exc
        except Exception as exc:
            raise CheckpointWriteError(
                f"saving checkpoint step {job.step} to {self.url} failed: {describe_storage_failure(exc)}"
            ) from exc
        finally:
            # never leave an optimizer waiting on a failed save (CUDA events complete whatever happens here);
            # once the copies are done (or abandoned) the fence has nothing left to order
            job.flat.staged.set()
            target = self._fence_target
            if target is not None and target[1] is job.flat:
                self._fence_target = None
        self.last_timings = job.timings
        self._last_committed = job.step
        logger.info(
            "checkpoint step %d committed at %s (%.1f MiB, %.2fs)",
            job.step,
            self.url,
            manifest.total_bytes / 2**20,
            time.perf_counter() - started,
        )
        return manifest

    @property
    def last_committed_step(self) -> int | None:
        if self._sharded is not None:
            return self._sharded.last_committed_step
        return self._last_committed

    @property
    def in_flight(self) -> bool:
        if self._sharded is not None and self._sharded.in_flight:
            return True
        return self._future is not None and not self._future.done()

    def abandon(self) -> None:
        if self._sharded is not None:
            self._sharded.abandon()

    def wait(self) -> None:
        if self._sharded is not None:
            self._sharded.wait()
        with self._lock:
            future, self._future = self._future, None
            if future is None:
                return
            future.result()  # raises CheckpointWriteError of a failed background save

    def _sharded_saver(self) -> Any:
        if self._sharded is None:
            from elastic.checkpoint.sharded import ShardedCheckpointer

            self._sharded = ShardedCheckpointer(self._storage, self._options, self._events)
        return self._sharded

    # -- loading --------------------------------------------------------------------------------------
    def list_snapshots(self) -> list[SnapshotInfo]:
        return [
            SnapshotInfo(step=e.step, path=self._storage.full_path(step_dir(e.step)), manifest=e.manifest)
            for e in scan(self._storage, self._options.signing_key)
            if e.manifest is not None
        ]

    def latest_step(self) -> int | None:
        snapshots = self.list_snapshots()
        return snapshots[-1].step if snapshots else None

    def _load_manifest(
        self, manifest: Manifest, template: Mapping[str, Any] | None, device: torch.device | str | None = None
    ) -> Snapshot:
        if self._options.layout == StateLayout.SHARDED:
            return self._sharded_saver().load(manifest, template)
        state = read_pack(
            self._storage,
            manifest,
            weights_only=self._options.weights_only,
            chunk_bytes=self._options.chunk_bytes,
            io_threads=self._options.io_threads,
            device=device,
        )
        return Snapshot(step=manifest.step, state=state, manifest=manifest, url=self.url)

    def _check_device(self, device: torch.device | str | None) -> None:
        if device is not None and self._options.layout == StateLayout.SHARDED:
            raise ValueError("device applies to the replicated layout (sharded state loads into its template)")

    def load(
        self, step: int, template: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
    ) -> Snapshot:
        """See :class:`CheckpointManager`; ``device`` (replicated layout): where the tensors are restored
        (CUDA: read through pinned buffers straight into device memory; ``None``: CPU)."""
        self._check_open()
        self._check_device(device)
        try:
            manifest = read_manifest(self._storage, step, self._options.signing_key)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"no committed snapshot at step {step} under {self.url}") from exc
        except ManifestError as exc:
            raise CheckpointCorruptError(f"snapshot step {step} under {self.url}: {exc}") from exc
        try:
            return self._load_manifest(manifest, template, device)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"snapshot step {step} under {self.url} is corrupt: {exc}") from exc

    def load_latest(
        self, template: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
    ) -> Snapshot | None:
        """See :class:`CheckpointManager`; ``device`` as for :meth:`load`."""
        self._check_open()
        self._check_device(device)
        if self._options.layout == StateLayout.SHARDED:
            return self._sharded_saver().load_latest(template, self._newest_verified_manifest)
        return self._newest_loadable(template, device)

    def _skip(self, step: int, why: str) -> None:
        logger.warning(
            "checkpoint step %d under %s is unusable (%s); falling back to the previous snapshot",
            step,
            self.url,
            why,
        )

    def _none_found(self) -> None:
        if not self._said_fresh:
            logger.warning("no valid checkpoint under %s; starting fresh", self.url)
            self._said_fresh = True

    def _newest_loadable(
        self, template: Mapping[str, Any] | None, device: torch.device | str | None = None
    ) -> Snapshot | None:
        for entry in reversed(scan(self._storage, self._options.signing_key)):
            if entry.manifest is None:
                if entry.problem:
                    self._skip(entry.step, entry.problem)
                continue
            try:
                return self._load_manifest(entry.manifest, template, device)
            except CheckpointCorruptError as exc:
                self._skip(entry.step, str(exc))
        self._none_found()
        return None

    def _newest_verified_manifest(self) -> Manifest | None:
        """Newest manifest whose files verify (sharded layout: rank 0 checks before everyone loads)."""
        from elastic.checkpoint.reader import verify_files

        for entry in reversed(scan(self._storage, self._options.signing_key)):
            if entry.manifest is None:
                if entry.problem:
                    self._skip(entry.step, entry.problem)
                continue
            try:
                verify_files(
                    self._storage, entry.manifest, self._options.chunk_bytes, io_threads=self._options.io_threads
                )
                return entry.manifest
            except CheckpointCorruptError as exc:
                self._skip(entry.step, str(exc))
        self._none_found()
        return None

    # -- shutdown -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
            self._warm_up.join()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._sharded is not None:
                self._sharded.close()
            for handle in list(self._fences.values()):
                handle.remove()
            self._fences.clear()
            self._stager.release()
            atexit.unregister(self._exit_hook)


def _stager_for(options: CheckpointOptions) -> Stager:
    settings = DeviceStagingSettings(
        enabled=options.device_staging,
        margin_bytes=options.device_staging_margin_bytes,
        margin_fraction=options.device_staging_margin_fraction,
    )
    pool = DeviceBufferPool(CUDA_MEMORY, settings)
    return Stager(pinned_limit_bytes=options.pinned_staging_bytes, device_pool=pool)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _make_exit_hook(ref: weakref.ref[FsspecCheckpointManager]) -> Any:
    def hook() -> None:
        manager = ref()
        if manager is None or manager._closed:
            return
        try:
            manager.close()
        except CheckpointError as exc:
            logger.error("checkpoint save pending at exit failed: %s", exc)

    return hook


def create_checkpoint_manager(
    url: str,
    options: CheckpointOptions | None = None,
    *,
    events: EventHook | None = None,
    storage: CheckpointStorage | None = None,
    stager: Stager | None = None,
) -> FsspecCheckpointManager:
    """A manager for ``url``; nothing is contacted until ``check_storage``/``save``/``load_latest``.

    ``storage`` replaces the back-end built from ``url`` (wrappers of our own storage interface); ``stager``
    the staging built from ``options`` (tests: in-memory copy streams and device memory).
    """
    opts = options or CheckpointOptions()
    if storage is None:
        stripe = StripeSettings(opts.lustre_striping, opts.lustre_stripe_count, opts.lustre_stripe_size)
        storage = create_storage(url, opts.storage_options, stripe)
    return FsspecCheckpointManager(storage, opts, events, stager=stager)
