"""A storage outage during training: the failed saves are reported, training goes on in the same worker
group (no restart), nothing committed is lost, and saving resumes when the storage is back. Real torchrun
(standalone), real files: the checkpoint directory is swapped for a plain file, so every write fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.checkpoint import create_checkpoint_manager
from elastic.testing.torchrun import read_jsonl
from elastic.testing.wait import wait_until

pytestmark = pytest.mark.timeout(240)


def test_a_storage_outage_costs_no_restart_and_loses_no_committed_snapshot(tmp_path: Path) -> None:
    ckpt, away, record = tmp_path / "ckpt", tmp_path / "ckpt.away", tmp_path / "record"
    pace = tmp_path / "pace"  # the steps sleep until the outage is over; the rest run at full speed
    pace.touch()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=2",
        "-m",
        "elastic.testing.train_worker",
        "--checkpoint-url",
        str(ckpt),
        "--record",
        str(record),
        "--samples",
        "2400",
        "--epochs",
        "1",
        "--batch",
        "8",
        "--base-world",
        "1",
        "--save-every",
        "5",
        "--step-sleep",
        "0.05",
        "--pace-file",
        str(pace),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = open(tmp_path / "torchrun.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        committed = lambda: create_checkpoint_manager(str(ckpt)).latest_step() or 0  # noqa: E731
        assert wait_until(lambda: committed() >= 20, 120)
        before = committed()
        os.rename(ckpt, away)
        ckpt.write_text("the storage is away")  # every write below it fails (ENOTDIR), as on a lost mount
        time.sleep(3)  # several saves (every 5 steps of ~0.05 s) fail meanwhile
        ckpt.unlink()
        os.rename(away, ckpt)
        pace.unlink()
        assert proc.wait(timeout=180) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        proc.kill()
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert "checkpoint save failed (failing for 0 s" in output and "saving step" in output
    steps = [r for f in record.glob("rank0.*.jsonl") for r in read_jsonl(f)]
    assert {r["restart"] for r in steps} == {0} and len({r["attempt"] for r in steps}) == 1  # no restart
    assert sorted(r["step"] for r in steps) == list(range(1, 301))  # every step once: nothing redone
    with create_checkpoint_manager(str(ckpt)) as mgr:
        kept = [s.step for s in mgr.list_snapshots()]
        assert before in kept and max(kept) == 300  # the pre-outage snapshot survived; saving resumed
        assert mgr.load(before).step == before
