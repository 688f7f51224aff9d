"""examples/hf_trainer.py, the plain Trainer script plus the one elastic line, as the docs run it: torchrun on the
etcd-v3 rendezvous, 2 workers, then again to a later step, resuming from its own snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from elastic.testing.etcd_server import LocalEtcdCluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


def _run(etcd: LocalEtcdCluster, tmp: Path, max_steps: int) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoints}",
        f"--rdzv-id=hf-ex-{uuid.uuid4().hex[:6]}",
        str(EXAMPLE),
        "--checkpoint-url",
        str(tmp / "ck"),
        "--output-dir",
        str(tmp / "out"),
        "--max-steps",
        str(max_steps),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp)


@pytest.mark.slow  # 2 cold torchrun runs of the example (the resume itself is in the default suite's tests)
@pytest.mark.timeout(300)
def test_hf_trainer_example_trains_then_resumes_from_its_own_snapshot(
    etcd_server: LocalEtcdCluster, tmp_path: Path
) -> None:
    first = _run(etcd_server, tmp_path, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["step"] == 4, first.stdout[-2000:]
    assert (tmp_path / "ck" / "step-000000000004" / "manifest.json").exists()
    again = _run(etcd_server, tmp_path, 6)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 4" in again.stderr, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["step"] == 6, again.stdout[-2000:]
