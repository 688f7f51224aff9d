"""The no-service HPC form under a real Slurm (``tests/deploy/slurm.py``): ``sbatch scripts/hpc/slurm-train.sh
train.py`` starts an etcd of its own in the allocation and ``srun torchrun --rdzv-backend=etcd-v3`` on every node.
A node lost mid-training: the job shrinks, finishes and ends COMPLETED; the time limit's warning (USR1): the
workers save, the job requeues itself and resumes from that snapshot. The timings are printed (``-s``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import REPO
from tests.deploy.slurm import LocalSlurm, missing
from tests.integration.training_records import read_records

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "scripts" / "hpc" / "slurm-train.sh"
WORKER = REPO / "elastic" / "testing" / "train_worker.py"


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[LocalSlurm]:
    problem = missing()
    if problem:
        pytest.fail(problem)
    # cred_expire=8: Slurm holds a requeued job back for a credential's lifetime (120 s by default)
    # message_timeout=3: slurmctld's pings of a lost node give up after 3 s, not 10: it is DOWN (and the job that
    # lost it ends) about 13 s sooner
    cluster = LocalSlurm(tmp_path / "slurm", slurmd_timeout=6, cred_expire=8, message_timeout=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _records(rec: Path) -> list[dict[str, Any]]:
    return sorted(read_records(rec), key=lambda r: r["t"])


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def _submit(slurm: LocalSlurm, tmp_path: Path, nodes: str, worker_args: list[str]) -> tuple[str, Path, Path]:
    rec, out = tmp_path / "rec", tmp_path / "train-%j.out"
    env = {
        "ETRAIN_TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "ETRAIN_PYTHON": sys.executable,
        "ETRAIN_ETCD_HOST": "127.0.0.1",
        "ETRAIN_ETCD_LISTEN": "127.0.0.1",
        "ETRAIN_CHECKPOINT_URL": str(tmp_path / "ck"),
        "ETRAIN_MAX_RESTARTS": "5",
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    args = [
        str(WORKER),
        "--record",
        str(rec),
        "--samples",
        "240",
        "--batch",
        "4",
        "--lr-rule",
        "linear",
        "--base-world",
        "3",
        "--save-every",
        "5",
        *worker_args,
    ]
    job = slurm.sbatch(f"--nodes={nodes}", f"--output={out}", str(SCRIPT), *args, env=env, cwd=REPO)
    return job, rec, Path(str(out).replace("%j", job))


def _job_field(slurm: LocalSlurm, job: str, field: str) -> str:
    done = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=slurm.env, timeout=30)
    for word in done.stdout.split():
        if word.startswith(f"{field}="):
            return word.split("=", 1)[1]
    return ""


def _node_pids(node: str) -> list[int]:
    """Every process of ``node``'s task (its environment names Slurm's node) and their slurmstepd."""
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not (entry.name.isascii() and entry.name.isdigit()):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in environ and b"SLURM_STEP_ID=0" in environ:
            pids.add(int(entry.name))
            pids.add(int(stat.rsplit(")", 1)[1].split()[1]))
    return sorted(pids)


def _log(log: Path) -> str:
    return log.read_text()[-4000:] if log.exists() else "(no output yet)"


def test_a_node_lost_mid_training_the_job_shrinks_finishes_and_ends_completed(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    job, rec, log = _submit(slurm, tmp_path, "3", ["--epochs", "2", "--step-sleep", "0.05"])
    assert _wait(lambda: any(r["world"] == 3 and r["step"] >= 8 for r in _records(rec)), 150), _log(log)
    lost_at = time.time()
    slurm.kill_node("n3", _node_pids("n3"))
    assert _wait(lambda: any(r["world"] == 2 and r["t"] > lost_at for r in _records(rec)), 120), _log(log)
    resumed = min(r["t"] for r in _records(rec) if r["world"] == 2 and r["t"] > lost_at)
    assert _wait(lambda: slurm.job_state(job) == "GONE", 200), _log(log)
    assert _job_field(slurm, job, "JobState") == "COMPLETED", _log(log)
    assert _job_field(slurm, job, "ExitCode") == "0:0", _log(log)
    final = json.loads((rec / "final.json").read_text())
    assert final["step"] >= 2 * 240 // 12, final  # 2 epochs, 12 samples a step at 3 workers, more at 2
    print(f"slurm-train.sh: node lost -> first step at world 2: {resumed - lost_at:.1f} s")


def test_the_time_limits_warning_saves_requeues_and_the_job_resumes_from_that_snapshot(
    slurm: LocalSlurm, tmp_path: Path
) -> None:
    job, rec, log = _submit(slurm, tmp_path, "2", ["--epochs", "2", "--step-sleep", "0.05", "--save-every", "1000"])
    assert _wait(lambda: any(r["step"] >= 10 for r in _records(rec)), 150), _log(log)
    first_pids = {r["pid"] for r in _records(rec)}
    warned_at = time.time()
    slurm.scancel(job, "--batch", "--signal=USR1")  # what --signal=B:USR1@120 sends before the time limit
    assert _wait(lambda: _job_field(slurm, job, "Restarts") == "1", 90), _log(log)
    requeued_at = time.time()
    assert _wait(lambda: slurm.job_state(job) == "PENDING", 60), _log(log)
    assert _wait(lambda: slurm.job_state(job) == "RUNNING", 90), _log(log)  # after Slurm's hold (cred_expire)
    started_at = time.time()
    assert _wait(lambda: any(r["pid"] not in first_pids for r in _records(rec)), 150), _log(log)
    saved = max(r["step"] for r in _records(rec) if r["pid"] in first_pids)
    first_step = min((r for r in _records(rec) if r["pid"] not in first_pids), key=lambda r: r["t"])
    assert _wait(lambda: slurm.job_state(job) == "GONE", 200), _log(log)
    assert _job_field(slurm, job, "JobState") == "COMPLETED", _log(log)
    assert "saved on the time limit's warning; requeueing" in _log(log)
    text = log.read_text()  # --open-mode=append: the requeued run's lines follow the first run's
    assert f"job {job} run 0," in text and f"job {job} run 1," in text, text[-3000:]
    steps = sorted({r["step"] for r in _records(rec)})
    assert steps == list(range(1, steps[-1] + 1)), "no step lost: the requeued run resumed from the warning's save"
    assert first_step["step"] == saved + 1, (first_step, saved)
    print(
        f"slurm-train.sh: USR1 -> saved and requeued {requeued_at - warned_at:.1f} s; the requeued run started -> "
        f"its first step {first_step['t'] - started_at:.1f} s; Slurm held it {started_at - requeued_at:.1f} s "
        "(cred_expire=8 on the test cluster, 120 s by default)"
    )
