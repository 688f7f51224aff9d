"""Replicated state (DDP: every rank holds all of it): one writer rank saves it in a background thread.

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
pinned buffers behind it (see ``device_staging``).  :meth:`ReplicatedCheckpointManager.prepare` allocates the
buffers in a background thread before the first save.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from elastic.checkpoint.api import (
    CheckpointError,
    CheckpointFencedError,
    CheckpointOptions,
    CheckpointWriteError,
    EventHook,
    Snapshot,
    StateLayout,
)
from elastic.checkpoint.base import StorageCheckpointManager, as_mapping, current_rank_and_world
from elastic.checkpoint.device_staging import CUDA_MEMORY, DeviceBufferPool, DeviceStagingSettings, tensor_bytes
from elastic.checkpoint.layout import Manifest
from elastic.checkpoint.reader import read_pack
from elastic.checkpoint.staging import FlatState, Stager
from elastic.checkpoint.storage import CheckpointStorage, describe_storage_failure
from elastic.checkpoint.warmup import StagingWarmUp
from elastic.checkpoint.writer import PackSaveJob

__all__ = ["ReplicatedCheckpointManager"]

logger = logging.getLogger("elastic.checkpoint.manager")  # where the manager's lines have always been


def _optimizer_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """Storage addresses of everything ``optimizer.step()`` writes: its parameters and state tensors."""
    owned = {p.untyped_storage().data_ptr() for group in optimizer.param_groups for p in group["params"]}
    for per_param in optimizer.state.values():
        owned.update(v.untyped_storage().data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    return owned


def _deferred_by(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
    """Which tensors an overlapped save copies after the others: those sharing storage with ``optimizer``'s."""
    owned = _optimizer_storages(optimizer)

    def defer(t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in owned

    return defer


class ReplicatedCheckpointManager(StorageCheckpointManager):
    """Saves ``StateLayout.REPLICATED`` state: only ``is_writer`` ranks write, as one pack (see the module
    docstring); loads read the pack on any rank, onto the CPU or the device a load names."""

    layout = StateLayout.REPLICATED

    def __init__(
        self,
        storage: CheckpointStorage,
        options: CheckpointOptions,
        events: EventHook | None = None,
        *,
        stager: Stager | None = None,
    ) -> None:
        """``stager`` replaces the one built from ``options`` (tests: in-memory copy streams and device)."""
        staging = stager if stager is not None else _stager_for(options)
        super().__init__(storage, options, events)
        self._stager = staging
        self._warm_up = StagingWarmUp(self._stager)
        self.last_device_staged_bytes = 0  # of the last save: bytes of CUDA tensors staged on their device
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[Manifest] | None = None
        self._last_committed: int | None = None
        self._lock = threading.RLock()
        self.last_blocking_s = 0.0
        self.last_fence_wait_s = 0.0
        # the optimizer the last overlapped save deferred copies for, and that save's staged state
        self._fence_target: tuple[weakref.ref[torch.optim.Optimizer], FlatState] | None = None
        self._fences: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()

    # -- saving ---------------------------------------------------------------------------------------
    def _prepare(self, state: Mapping[str, Any] | Any) -> None:
        """A background thread (``checkpoint-warm-up``) allocates the staging buffers of ``state``'s tensors once
        the save in flight (if any) is written; a save waits for it.  Nothing where this rank does not write."""
        if not self.is_writer:
            return
        mapping = as_mapping(state)
        with self._lock:
            self._warm_up.start(mapping, self._future)

    def wait_prepared(self) -> None:
        """Block until the staging warm-up started by :meth:`prepare` (if any) is done (benchmarks, tests)."""
        self._warm_up.join()

    def _warm_up_waited(self, seconds: float) -> None:
        logger.info("checkpoint save waited %.3fs for the staging warm-up to finish", seconds)

    def _save(
        self, step: int, state: Mapping[str, Any], *, blocking: bool, overlap_with: torch.optim.Optimizer | None
    ) -> None:
        """CUDA tensors are queued for copying on a copy stream (see ``Stager``): save returns without waiting
        for the device, and the current stream is ordered after the copies.  With ``overlap_with``, tensors
        sharing storage with the optimizer's parameters or state are copied after the others (CUDA: queued last;
        CPU: by the writer thread), and an optimizer pre-step hook orders its next ``step()`` after that copy
        (CUDA: GPU-side; CPU: the host waits).  Other tensors (buffers such as BatchNorm statistics, RNG states,
        ...) are copied, or ordered before the next forward, before returning."""
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
                defer = _deferred_by(overlap_with)
            flat = self._stager.flatten(state, copy=not blocking, defer=defer)
            self.last_device_staged_bytes = sum(tensor_bytes(flat.tensors[i]) for i in flat.device_staged)
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
        return self._last_committed

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self) -> None:
        with self._lock:
            future, self._future = self._future, None
            if future is None:
                return
            future.result()  # raises CheckpointWriteError of a failed background save

    # -- loading --------------------------------------------------------------------------------------
    def _load_manifest(
        self, manifest: Manifest, template: Mapping[str, Any] | None, device: torch.device | str | None
    ) -> Snapshot:
        """The pack of ``manifest``, verified as it is read, its tensors on ``device`` (CUDA: read through pinned
        buffers straight into device memory; ``None``: CPU); ``template`` is not needed."""
        state = read_pack(
            self._storage,
            manifest,
            weights_only=self._options.weights_only,
            chunk_bytes=self._options.chunk_bytes,
            io_threads=self._options.io_threads,
            device=device,
        )
        return Snapshot(step=manifest.step, state=state, manifest=manifest, url=self.url)

    def _load_newest(self, template: Mapping[str, Any] | None, device: torch.device | str | None) -> Snapshot | None:
        """The newest snapshot whose pack reads and verifies (each rank reads it itself)."""
        return self._newest(lambda manifest: self._load_manifest(manifest, template, device))

    # -- shutdown -------------------------------------------------------------------------------------
    def _drain(self) -> None:
        self.wait()
        self._warm_up.join()

    def _release(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for handle in list(self._fences.values()):
            handle.remove()
        self._fences.clear()
        self._stager.release()


def _stager_for(options: CheckpointOptions) -> Stager:
    settings = DeviceStagingSettings(
        enabled=options.device_staging,
        margin_bytes=options.device_staging_margin_bytes,
        margin_fraction=options.device_staging_margin_fraction,
    )
    pool = DeviceBufferPool(CUDA_MEMORY, settings)
    return Stager(pinned_limit_bytes=options.pinned_staging_bytes, device_pool=pool)
