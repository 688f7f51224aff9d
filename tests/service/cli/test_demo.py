"""What the demo prints about a job's checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.checkpoint import create_checkpoint_manager
from service.cli.demo import snapshot_sizes


def test_snapshot_sizes_count_the_bytes_of_each_snapshot_not_its_directory_entry(tmp_path: Path) -> None:
    # The demo printed "4096 bytes" for every snapshot: the size of the directory entry.
    manager = create_checkpoint_manager(f"file://{tmp_path}")
    weights = torch.zeros(64 * 1024)  # 256 KiB of float32
    for step in (10, 20):
        manager.save(step, {"model": {"w": weights + step}, "step": step})
    manager.wait()
    manager.close()
    listed = dict(snapshot_sizes(tmp_path))
    snapshots = {name: size for name, size in listed.items() if name.endswith("/")}
    assert len(snapshots) == 2, listed
    for name, size in snapshots.items():
        on_disk = sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
        assert size == on_disk > weights.numel() * 4, (name, size)
    assert snapshot_sizes(tmp_path / "missing") == []
