"""The examples: the elastic version of the tutorial DDP script changes at most 10 lines, and both run."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.torchrun import shared_zygote

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _changed_lines(a: Path, b: Path) -> int:
    def body(p: Path) -> list[str]:
        lines = p.read_text().splitlines()
        start = lines.index('"""', 1) + 1 if lines[0].startswith('"""') and lines[0].count('"""') == 1 else 1
        return [ln for ln in lines[start:] if ln.strip()]  # the module docstring is prose, not code

    diff = difflib.unified_diff(body(a), body(b), lineterm="", n=0)
    removed = added = 0
    for line in diff:
        if line.startswith("-") and not line.startswith("---"):
            removed += 1
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
    return max(removed, added)


def test_elastic_digits_changes_at_most_10_lines_of_the_ddp_script() -> None:
    changed = _changed_lines(EXAMPLES / "ddp_digits.py", EXAMPLES / "elastic_digits.py")
    assert changed <= 10, f"{changed} lines changed"


def _torchrun(
    etcd: LocalEtcdCluster,
    script: str,
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    warm: bool = True,
) -> subprocess.CompletedProcess[str]:
    """The README's command; ``warm``: with ``-m elastic.prefork`` (its warm starts), the workers forked from this
    test process's zygote (one torch import for the suite's runs: ``shared_zygote``)."""
    prefork = ["-m", "elastic.prefork"] if warm else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoints}",
        f"--rdzv-id=ex-{uuid.uuid4().hex[:6]}",
        *prefork,
        str(EXAMPLES / script),
        *args,
    ]
    full_env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", **(env or {}))
    if warm:
        full_env.update(shared_zygote())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=full_env, cwd=EXAMPLES)


@pytest.mark.timeout(300)
def test_elastic_digits_trains_and_resumes_from_its_checkpoint(etcd_server: LocalEtcdCluster, tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    # cold, as the README's first command: the others start warm (the resumed run too: its workers import torch
    # once, in the shared zygote, not twice more)
    env = {"ETRAIN_CHECKPOINT_URL": ck}
    first = _torchrun(etcd_server, "elastic_digits.py", ["--epochs", "2"], env=env, warm=False)
    assert first.returncode == 0, first.stderr[-3000:]
    # 1797 samples, global batch 2 x 32: 29 steps per epoch.
    assert "world 2" in first.stderr and "epoch 1 done at step 58" in first.stderr, first.stderr[-3000:]
    again = _torchrun(etcd_server, "elastic_digits.py", ["--epochs", "3"], env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 58" in again.stderr and "epoch 2 done at step 87" in again.stderr, again.stderr[-3000:]


@pytest.mark.timeout(300)
def test_elastic_chargpt_trains_on_the_committed_text(etcd_server: LocalEtcdCluster, tmp_path: Path) -> None:
    run = _torchrun(etcd_server, "elastic_chargpt.py", ["--epochs", "1", "--checkpoint-url", str(tmp_path / "ck")])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done at step" in run.stderr and "loss" in run.stderr, run.stderr[-3000:]


@pytest.mark.timeout(300)
def test_elastic_fsdp_trains_sharded_then_resumes_as_hsdp_on_4_workers(
    etcd_server: LocalEtcdCluster, tmp_path: Path
) -> None:
    """The FSDP2 example on 2 workers to step 12 (a sharded snapshot every 10 steps), then on 4 workers as HSDP
    (2 replicas x 2 shards): the step-10 snapshot is resharded on load and training goes on from there."""
    ck = ["--checkpoint-url", str(tmp_path / "ck"), "--save-every", "10"]
    first = _torchrun(etcd_server, "elastic_fsdp.py", [*ck, "--max-steps", "12"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "world 2, mesh (1, 2), resumed at step 0" in first.stderr, first.stderr[-3000:]
    assert "done at step 12" in first.stderr, first.stderr[-3000:]
    assert list((tmp_path / "ck").glob("step-000000000010/*/*.distcp")), "a sharded (DCP) snapshot"
    again = _torchrun(etcd_server, "elastic_fsdp.py", [*ck, "--max-steps", "14", "--shard-size", "2"], nproc=4)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "world 4, mesh (2, 2), resumed at step 10" in again.stderr, again.stderr[-3000:]
    assert "done at step 14" in again.stderr, again.stderr[-3000:]
