"""The two implementations of the checkpoint manager: the factory picks one from the layout, each refuses
options of the other layout, and the name the manager had before the split builds the replicated one."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointOptions, FsspecCheckpointManager, StateLayout, create_checkpoint_manager
from elastic.checkpoint.base import StorageCheckpointManager
from elastic.checkpoint.replicated import ReplicatedCheckpointManager
from elastic.checkpoint.sharded import ShardedCheckpointManager
from elastic.checkpoint.storage import LocalStorage

SHARDED = CheckpointOptions(layout=StateLayout.SHARDED)


@pytest.mark.timeout(60)
def test_the_factory_builds_the_implementation_of_the_layout(tmp_path: Path) -> None:
    with create_checkpoint_manager(str(tmp_path / "r")) as replicated:
        assert type(replicated) is ReplicatedCheckpointManager
    with create_checkpoint_manager(str(tmp_path / "s"), SHARDED) as sharded:
        assert type(sharded) is ShardedCheckpointManager
    assert isinstance(replicated, StorageCheckpointManager) and isinstance(sharded, StorageCheckpointManager)
    assert FsspecCheckpointManager is ReplicatedCheckpointManager


@pytest.mark.timeout(60)
def test_an_implementation_refuses_the_options_of_the_other_layout(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(ValueError, match="saves replicated state, the options name sharded"):
        ReplicatedCheckpointManager(storage, SHARDED)
    with pytest.raises(ValueError, match="saves sharded state, the options name replicated"):
        ShardedCheckpointManager(storage, CheckpointOptions())
