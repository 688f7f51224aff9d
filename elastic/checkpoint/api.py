"""The checkpoint interface the training loop uses, its options, and its errors.

A *snapshot* is the full training state at one step, stored under ``<root>/step-<step>/`` and made to
exist by one act: writing its manifest (file list, sizes, digests) after all of its data.  Anything
without a valid manifest does not exist for readers.
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from elastic.checkpoint.digest import DEFAULT_DIGEST, DigestAlgorithm, parse_algorithm
from elastic.checkpoint.verification import VerifyMode, parse_verify_mode

if TYPE_CHECKING:
    import torch

    from elastic.checkpoint.layout import Manifest
    from elastic.checkpoint.state import TrainingState

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointStorageError",
    "CheckpointWriteError",
    "EventHook",
    "Snapshot",
    "SnapshotInfo",
    "StateLayout",
]

#: Called with a named progress point of a save ("data_begin", "data_chunk", "manifest_committed", ...),
#: from the thread that does the work.  For metrics and fault-injection tests; it must be quick.
EventHook = Callable[[str], None]


class CheckpointError(Exception):
    """Base class of every checkpoint failure."""


class CheckpointStorageError(CheckpointError):
    """The storage cannot be used (bad URL, missing bucket or credentials, read-only path).

    The message is one line naming the URL and the reason.
    """


class CheckpointWriteError(CheckpointError):
    """A save failed; for a background save this is raised by the next ``save``/``wait``/``close``."""


class CheckpointFencedError(CheckpointWriteError):
    """A save of job generation *g* was refused: a newer generation has committed under the same root (this
    process belongs to a generation the job has moved on from; it must stop, not overwrite or delete)."""


class CheckpointCorruptError(CheckpointError):
    """A snapshot failed verification (missing file, size or digest mismatch, bad manifest)."""


class CheckpointLoadError(CheckpointError):
    """A verified snapshot could not be decoded or applied (a bug or an incompatible state, not rot)."""


class StateLayout(str, enum.Enum):
    """How the state is spread over ranks.

    ``replicated``: every rank holds the same state (DDP); one rank (see ``writer_rank``) writes it.
    ``sharded``: each rank holds a part (FSDP/DTensor); every rank writes its part through
    ``torch.distributed.checkpoint`` and rank 0 commits the manifest.
    """

    REPLICATED = "replicated"
    SHARDED = "sharded"


_MIB = 1 << 20


@dataclass(frozen=True)
class CheckpointOptions:
    """Settings of one checkpoint manager (see docs/checkpoints.md for the table).

    ``storage_options`` go to fsspec unchanged (e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for s3fs).
    ``keep_last`` snapshots are kept (the one just written counts), plus every snapshot whose step is a
    multiple of ``keep_every`` when set.  ``lustre_stripe_*`` are used when an ``lfs`` executable is on
    ``PATH`` and the root is a local path.  ``per_node`` (replicated layout): the first worker of every node
    (``LOCAL_RANK`` 0) writes instead of one rank of the world, for node-local storage such as ``/dev/shm``.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # may hold secrets
    layout: StateLayout = StateLayout.REPLICATED
    keep_last: int = 3
    keep_every: int | None = None
    writer_rank: int = 0
    per_node: bool = False
    # what is checked right after a save commits (elastic/checkpoint/verification.py): "auto" (cheap on local
    # file systems, a read-back from the medium on network file systems and object stores), "none", "size",
    # "read_back", "read_back_uncached"; the former bools map to read_back (True) and none (False)
    verify_after_write: VerifyMode | str | bool = VerifyMode.AUTO
    # the digest of new snapshots' files (elastic/checkpoint/digest.py); loads verify whichever a manifest names
    digest_algorithm: DigestAlgorithm | str = DEFAULT_DIGEST
    weights_only: bool = True
    chunk_bytes: int = 8 * _MIB
    # tensor data is written as files of this size (each with its own digest in the manifest), by io_threads
    # threads in parallel; loads and verification read them in parallel too (None: sized to the machine)
    segment_bytes: int = 256 * _MIB
    io_threads: int | None = None
    # page-locked host memory kept for staging CUDA tensors (reused from save to save); beyond it, or when
    # pinning fails, staging uses ordinary memory (slower device-to-host copies, logged once). 0: never pin
    pinned_staging_bytes: int = 16 * 1024 * _MIB
    # device-side staging of CUDA tensors (see docs/checkpoints.md): a save's fences wait only for a copy into
    # reused buffers on the device, drained to the pinned host buffers over the next steps; per device, the
    # buffers leave max(device_staging_margin_bytes, device_staging_margin_fraction * total) free, and tensors
    # that do not fit are copied straight to the host. False: always straight to the host
    device_staging: bool = True
    device_staging_margin_bytes: int = 2 * 1024 * _MIB
    device_staging_margin_fraction: float = 0.05
    lustre_striping: bool = True
    lustre_stripe_count: int = 4
    lustre_stripe_size: str = "4M"
    # HMAC key of this job's manifests (the service gives each job one): only snapshots signed with it are
    # loaded, listed or counted by retention. None: any manifest whose checksums hold is trusted.
    signing_key: bytes | None = field(default=None, repr=False)
    # the job generation saving (the service's, from ETRAIN_GENERATION): recorded in every manifest; a save is
    # refused once a newer generation has committed under the root. None: no fencing.
    generation: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.signing_key, str):  # from a mapping or the environment: hex
            try:
                object.__setattr__(self, "signing_key", bytes.fromhex(self.signing_key))
            except ValueError:
                raise ValueError("signing_key must be bytes or a hex string") from None
        if self.signing_key is not None and len(self.signing_key) < 16:
            raise ValueError("signing_key must have at least 16 bytes")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 when set, got {self.keep_every}")
        if self.writer_rank < 0:
            raise ValueError(f"writer_rank must be >= 0, got {self.writer_rank}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if self.segment_bytes < self.chunk_bytes:
            raise ValueError(f"segment_bytes must be >= chunk_bytes ({self.chunk_bytes}), got {self.segment_bytes}")
        if self.io_threads is not None and not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in 1..64 or None, got {self.io_threads}")
        if self.pinned_staging_bytes < 0:
            raise ValueError(f"pinned_staging_bytes must be >= 0, got {self.pinned_staging_bytes}")
        if self.device_staging_margin_bytes < 0:
            raise ValueError(f"device_staging_margin_bytes must be >= 0, got {self.device_staging_margin_bytes}")
        if not 0.0 <= self.device_staging_margin_fraction < 1.0:
            raise ValueError(
                f"device_staging_margin_fraction must be in [0, 1), got {self.device_staging_margin_fraction}"
            )
        if self.lustre_stripe_count < -1 or self.lustre_stripe_count == 0:
            raise ValueError(f"lustre_stripe_count must be -1 (all OSTs) or >= 1, got {self.lustre_stripe_count}")
        if not re.fullmatch(r"[1-9][0-9]*[KkMmGg]?", self.lustre_stripe_size):
            raise ValueError(f"lustre_stripe_size must look like 1048576, 4M or 1G, got {self.lustre_stripe_size!r}")
        object.__setattr__(self, "layout", StateLayout(self.layout))
        object.__setattr__(self, "verify_after_write", parse_verify_mode(self.verify_after_write))
        try:
            object.__setattr__(self, "digest_algorithm", parse_algorithm(self.digest_algorithm))
        except ValueError as exc:
            raise ValueError(f"digest_algorithm: {exc}") from None
        if self.per_node and self.layout == StateLayout.SHARDED:
            raise ValueError("per_node applies to the replicated layout (each rank of a sharded state writes its part)")

    @property
    def verify_mode(self) -> VerifyMode:
        """``verify_after_write`` as a :class:`VerifyMode` (``auto`` is resolved per storage at save time)."""
        return parse_verify_mode(self.verify_after_write)

    @property
    def file_digest(self) -> DigestAlgorithm:
        """``digest_algorithm`` as a :class:`DigestAlgorithm`."""
        return parse_algorithm(self.digest_algorithm)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CheckpointOptions:
        """Build from a plain mapping (a job spec); unknown keys raise ``ValueError`` naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown checkpoint option(s): {', '.join(unknown)}")
        return cls(**dict(values))


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot as listed from its manifest (its data is not verified by listing)."""

    step: int
    path: str
    manifest: Manifest


@dataclass(frozen=True)
class Snapshot:
    """A verified, loaded snapshot: ``state`` is the mapping given to ``save`` (tensors on CPU, or on the
    device the load asked for)."""

    step: int
    state: Mapping[str, Any]
    manifest: Manifest
    url: str

    def training_state(self) -> TrainingState:
        """``state`` as a :class:`~elastic.checkpoint.state.TrainingState` (when it was saved as one)."""
        from elastic.checkpoint.state import TrainingState

        return TrainingState.from_dict(self.state)


_Manager = TypeVar("_Manager", bound="CheckpointManager")


class CheckpointManager(ABC):
    """Saves and restores training state snapshots on one storage root.

    One implementation per :class:`StateLayout`, chosen by ``create_checkpoint_manager``:
    ``elastic.checkpoint.replicated.ReplicatedCheckpointManager`` and
    ``elastic.checkpoint.sharded.ShardedCheckpointManager``, both built on what
    ``elastic.checkpoint.base.StorageCheckpointManager`` shares.

    Contract:
    - ``check_storage()`` proves at start-up that the root is usable (write, read back, delete) and
      raises :class:`CheckpointStorageError` with one line otherwise.
    - ``save(step, state, blocking=False)`` returns once the state is copied to CPU memory (CUDA tensors:
      once their copies are queued and the current stream is ordered after them); the write runs in the
      background.  At most one save is in flight: a new save first waits for the previous
      one and raises its error (:class:`CheckpointWriteError`) instead of starting.  With
      ``overlap_with=optimizer`` it returns before copying that optimizer's tensors (see ``save``).
      ``blocking=True`` returns once the snapshot is committed.  With the replicated layout only
      ``is_writer`` ranks write; other ranks return at once.  ``step`` must grow monotonically.
    - A snapshot exists once its manifest is committed, which happens after all its data is durable;
      a crash at any point leaves either the previous set of snapshots or the new one, never a torn one.
    - ``load_latest()`` returns the newest snapshot that passes verification (sizes and digests), warning
      about each newer one it skips, or ``None`` (logged once) when there is none.
    - ``close()`` waits for the in-flight save and raises its error; the manager is unusable afterwards.
    - ``abandon()`` gives up an in-flight save that needs the process group (its error is logged, not raised).
    - Retention runs after a save is committed and verified and only deletes snapshots older than it.
    """

    @property
    @abstractmethod
    def url(self) -> str:
        """The root URL snapshots live under."""

    @property
    @abstractmethod
    def options(self) -> CheckpointOptions:
        """The options this manager was built with."""

    @property
    @abstractmethod
    def is_writer(self) -> bool:
        """Whether this process writes replicated snapshots (rank ``writer_rank`` of the saving world, or
        with ``per_node`` the first worker of each node)."""

    @abstractmethod
    def check_storage(self) -> None:
        """Raise :class:`CheckpointStorageError` unless the root can be written, read and deleted."""

    @abstractmethod
    def save(
        self,
        step: int,
        state: Mapping[str, Any] | Any,
        *,
        blocking: bool = False,
        overlap_with: torch.optim.Optimizer | None = None,
    ) -> None:
        """Snapshot ``state`` (a mapping or a ``TrainingState``) at ``step``.

        The snapshot holds the values at the time of the call.  CUDA tensors are copied to pinned host
        buffers on a copy stream: ``save`` returns once the copies are queued (no host synchronization) and
        later work on the current stream is ordered after them.

        ``overlap_with`` (background saves of replicated state): the parameters and state of this
        optimizer are copied while the next forward/backward runs (CUDA: on the copy stream; CPU: by the
        writer thread), and the optimizer's next ``step()`` is ordered after that copy (CUDA: the stream
        waits, GPU-side; CPU: the host waits).  Only valid if nothing else changes them in between; all
        other tensors are copied (or, on CUDA, ordered before any later work) before ``save`` returns.
        """

    def prepare(self, state: Mapping[str, Any] | Any) -> None:
        """Allocate, in the background, the staging buffers a save of ``state`` will use (pinned host
        buffers, and device buffers as memory allows), so that the first save costs what later ones do.
        Returns at once; idempotent (a state with the same tensors again does nothing).  A save that arrives
        before the allocation is done waits for it.  The default does nothing."""
        return None

    @abstractmethod
    def wait(self) -> None:
        """Block until no save is in flight; raise the error of a failed background save."""

    def abandon(self) -> None:
        """A live re-form after a failure is about to replace the process group: stop waiting for a background
        save that still needs the old group's collectives (the sharded layout gathers its shards' metadata when
        their writes are done). Its outcome is logged, never raised by a later ``save``, ``wait`` or ``close``;
        it commits only if every rank's part did, so the committed snapshots are never torn. The default does
        nothing: saves of the replicated layout run no collective in the background and go on."""
        return None

    @property
    @abstractmethod
    def in_flight(self) -> bool:
        """Whether a background save is still running."""

    @property
    @abstractmethod
    def last_committed_step(self) -> int | None:
        """The step of the newest save by this manager that committed (None: none yet, or not a writer)."""

    @abstractmethod
    def load_latest(
        self, template: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
    ) -> Snapshot | None:
        """The newest verified snapshot, or ``None``; ``template`` is needed by the sharded layout.

        ``device`` (replicated layout): where the restored tensors live; a CUDA device is loaded straight
        into device memory.  ``None`` (the default): CPU.
        """

    @abstractmethod
    def load(
        self, step: int, template: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
    ) -> Snapshot:
        """The snapshot at ``step``; raises :class:`CheckpointCorruptError` if missing or invalid.  ``device``
        as for :meth:`load_latest`."""

    @abstractmethod
    def list_snapshots(self) -> list[SnapshotInfo]:
        """Committed snapshots (valid manifests), oldest first, without verifying their data."""

    @abstractmethod
    def latest_step(self) -> int | None:
        """Step of the newest committed snapshot (manifest only, data not verified), or ``None``."""

    @abstractmethod
    def close(self) -> None:
        """Flush the in-flight save and release resources; raises a pending background error."""

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
