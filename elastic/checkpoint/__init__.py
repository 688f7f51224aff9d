"""Verified, atomic, asynchronous checkpoints on shared storage (local/Lustre paths, S3, any fsspec URL).

Entry point: :func:`create_checkpoint_manager`; see docs/checkpoints.md.
"""

from elastic.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointLoadError,
    CheckpointManager,
    CheckpointOptions,
    CheckpointStorageError,
    CheckpointWriteError,
    EventHook,
    Snapshot,
    SnapshotInfo,
    StateLayout,
)
from elastic.checkpoint.digest import DigestAlgorithm
from elastic.checkpoint.layout import Manifest, writer_rank_for
from elastic.checkpoint.manager import (
    FsspecCheckpointManager,
    create_checkpoint_manager,
    current_rank_and_world,
)
from elastic.checkpoint.state import (
    TrainingState,
    capture_rng_state,
    capture_training_state,
    restore_rng_state,
    restore_training_state,
)
from elastic.checkpoint.verification import VerifyMode

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFencedError",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointStorageError",
    "CheckpointWriteError",
    "DigestAlgorithm",
    "EventHook",
    "FsspecCheckpointManager",
    "Manifest",
    "Snapshot",
    "SnapshotInfo",
    "StateLayout",
    "TrainingState",
    "VerifyMode",
    "capture_rng_state",
    "capture_training_state",
    "create_checkpoint_manager",
    "current_rank_and_world",
    "restore_rng_state",
    "restore_training_state",
    "writer_rank_for",
]
