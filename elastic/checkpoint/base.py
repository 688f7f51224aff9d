"""What both checkpoint managers share: one storage root, listing, verified loads with fallback, closing.

:class:`StorageCheckpointManager` implements the parts of :class:`~elastic.checkpoint.api.CheckpointManager`
that do not depend on how the state is spread over ranks, and leaves the rest to its two implementations, each
chosen once by :func:`~elastic.checkpoint.manager.create_checkpoint_manager` from ``CheckpointOptions.layout``:

- :class:`~elastic.checkpoint.replicated.ReplicatedCheckpointManager`: one writer rank stages the whole state and
  writes it in a background thread (``StateLayout.REPLICATED``);
- :class:`~elastic.checkpoint.sharded.ShardedCheckpointManager`: every rank writes its shards through DCP and
  rank 0 commits the manifest (``StateLayout.SHARDED``).

The public methods here check what the contract requires of every call (the manager is open, ``step >= 0``,
the state is a mapping or a ``TrainingState``) and hand over to the implementation's hooks (``_save``,
``_load_manifest``, ``_load_newest``, ...).  What a save does once its data is written, the generation fence,
the manifest commit, verification and retention, is :func:`~elastic.checkpoint.writer.finish_commit` and
:func:`~elastic.checkpoint.writer.check_fence`, called by both writers.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from elastic.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointOptions,
    EventHook,
    Snapshot,
    SnapshotInfo,
    StateLayout,
)
from elastic.checkpoint.layout import Manifest, ManifestError, step_dir, writer_rank_for
from elastic.checkpoint.reader import read_manifest, scan
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.storage import CheckpointStorage
from elastic.checkpoint.writer import SaveTimings
from elastic.contract.env import TorchrunEnv

__all__ = ["StorageCheckpointManager", "as_mapping", "current_rank_and_world"]

# the manager's lines (commits, fallbacks, "starting fresh") keep the logger they have always had, where users
# and their log filters look for them, whichever module of the split writes them
logger = logging.getLogger("elastic.checkpoint.manager")

_T = TypeVar("_T")


def current_rank_and_world() -> tuple[int, int]:
    """(rank, world size) from ``torch.distributed`` if initialized, else ``RANK``/``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    torchrun = TorchrunEnv.from_environ()
    return torchrun.rank, torchrun.world_size


def as_mapping(state: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """``state`` as the mapping a save writes: a ``TrainingState``'s dict, a mapping as it is; else TypeError."""
    if isinstance(state, TrainingState):
        return state.to_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping or a TrainingState, got {type(state).__name__}")
    return state


class StorageCheckpointManager(CheckpointManager):
    """A :class:`CheckpointManager` over one :class:`CheckpointStorage` root (see the module docstring).

    ``layout`` (a class attribute) is the one layout an implementation serves: built with options of another
    layout it raises ``ValueError`` (``create_checkpoint_manager`` picks the implementation from the options).
    Once built, the manager closes itself at interpreter exit if nobody did (waiting for the save in flight and
    logging its error).
    """

    layout: ClassVar[StateLayout]

    def __init__(self, storage: CheckpointStorage, options: CheckpointOptions, events: EventHook | None = None) -> None:
        if options.layout != self.layout:
            raise ValueError(
                f"{type(self).__name__} saves {self.layout.value} state, the options name {options.layout.value}: "
                "build managers with create_checkpoint_manager"
            )
        self._storage = storage
        self._options = options
        self._events = events
        storage.events = events
        self._closed = False
        self._said_fresh = False
        # the phases of the last save that committed (replicated layout; the sharded one does not measure them)
        self.last_timings = SaveTimings()
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

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is closed")

    # -- saving ---------------------------------------------------------------------------------------
    def prepare(self, state: Mapping[str, Any] | Any) -> None:
        """See :class:`CheckpointManager`; what is prepared is the implementation's (``_prepare``)."""
        self._check_open()
        self._prepare(state)

    def _prepare(self, state: Mapping[str, Any] | Any) -> None:
        """Start allocating what a save of ``state`` needs, in the background; the default: nothing."""
        return None

    def save(
        self,
        step: int,
        state: Mapping[str, Any] | Any,
        *,
        blocking: bool = False,
        overlap_with: torch.optim.Optimizer | None = None,
    ) -> None:
        """See :class:`CheckpointManager`; raises ``ValueError`` for a negative ``step``, ``TypeError`` for a state
        that is neither a mapping nor a ``TrainingState``, then saves as the implementation does (``_save``)."""
        self._check_open()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._save(step, as_mapping(state), blocking=blocking, overlap_with=overlap_with)

    @abstractmethod
    def _save(
        self, step: int, state: Mapping[str, Any], *, blocking: bool, overlap_with: torch.optim.Optimizer | None
    ) -> None:
        """:meth:`save` of a checked ``step`` and ``state``."""

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

    def load(
        self, step: int, template: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
    ) -> Snapshot:
        """See :class:`CheckpointManager`: the manifest of ``step`` is read (missing or invalid:
        :class:`CheckpointCorruptError`), then loaded as the implementation does (``_load_manifest``)."""
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
        """See :class:`CheckpointManager`; which snapshot and how is the implementation's (``_load_newest``)."""
        self._check_open()
        self._check_device(device)
        return self._load_newest(template, device)

    def _check_device(self, device: torch.device | str | None) -> None:
        """Raise ``ValueError`` where this layout cannot load onto ``device``; the default: any device."""
        return None

    @abstractmethod
    def _load_manifest(
        self, manifest: Manifest, template: Mapping[str, Any] | None, device: torch.device | str | None
    ) -> Snapshot:
        """The snapshot of ``manifest``; raises :class:`CheckpointCorruptError` if its files do not verify."""

    @abstractmethod
    def _load_newest(self, template: Mapping[str, Any] | None, device: torch.device | str | None) -> Snapshot | None:
        """:meth:`load_latest` of a checked ``device``."""

    def _newest(self, attempt: Callable[[Manifest], _T]) -> _T | None:
        """``attempt`` on each committed manifest, newest first, until one does not raise
        :class:`CheckpointCorruptError`; each skipped snapshot is warned about, none left is logged once."""
        for entry in reversed(scan(self._storage, self._options.signing_key)):
            if entry.manifest is None:
                if entry.problem:
                    self._skip(entry.step, entry.problem)
                continue
            try:
                return attempt(entry.manifest)
            except CheckpointCorruptError as exc:
                self._skip(entry.step, str(exc))
        self._none_found()
        return None

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

    # -- shutdown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """See :class:`CheckpointManager`: ``_drain`` (waits for the background work, raising a save's error),
        then, whatever it raised, the manager is closed and ``_release`` frees what the implementation holds."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._release()
            atexit.unregister(self._exit_hook)

    def _drain(self) -> None:
        """Wait for the background work before closing; the default: :meth:`wait`."""
        self.wait()

    def _release(self) -> None:
        """Free what the implementation holds (threads, hooks, buffers); runs once, at close; the default: nothing."""
        return None


def _make_exit_hook(ref: weakref.ref[StorageCheckpointManager]) -> Callable[[], None]:
    def hook() -> None:
        manager = ref()
        if manager is None or manager._closed:
            return
        try:
            manager.close()
        except CheckpointError as exc:
            logger.error("checkpoint save pending at exit failed: %s", exc)

    return hook
