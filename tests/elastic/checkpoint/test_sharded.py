"""Sharded (DTensor) state through torch.distributed.checkpoint under our manifest, real torchrun ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager
from tests.elastic.checkpoint._sharded_worker import full_state
from tests.elastic.checkpoint.conftest import Target

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(240)
def test_two_ranks_save_sharded_state_load_it_back_and_fall_back_on_corruption(target: Target, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tests/elastic/checkpoint/_sharded_worker.py"),
        target.url,
        str(out),
        json.dumps(target.storage_options),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result == {
            "rank": rank,
            "latest_step": 2,
            "latest_equal": True,
            "fallback_step": 1,
            "fallback_equal": True,
        }
    assert "blake3 mismatch" in proc.stderr and "falling back to the previous snapshot" in proc.stderr

    # a world of one process loads the snapshot written by two ranks (DCP reshards), verified first
    options = CheckpointOptions(layout=StateLayout.SHARDED, storage_options=target.storage_options)
    template = {"w": torch.zeros(64, 8), "b": torch.zeros(5, dtype=torch.bfloat16), "cursor": {"epoch": -1}}
    with create_checkpoint_manager(target.url, options) as mgr:
        snap = mgr.load(1, template=template)
    expected = full_state(1)
    assert torch.equal(snap.state["w"], expected["w"]) and torch.equal(snap.state["b"], expected["b"])
    assert snap.state["cursor"] == {"epoch": 1}
