"""Node-local snapshots a SIGKILLed worker left in ``/dev/shm`` are deleted by the next worker to start on the node
once their owners are gone, and a live owner's are kept (elastic/checkpoint/owners.py).

The first test runs real training processes (tests/elastic/train/_plain_script.py, a world of one without
torchrun, node-local snapshots every step) under a root of its own in the real ``/dev/shm``, SIGKILLs them, and
lets a new worker's start-up clear up; the others exercise the claim and the sweep in this process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.checkpoint.owners import OWNERS, claim_job_dir, owner_processes, sweep
from elastic.checkpoint.tiers import local_tier_dir
from elastic.proctree import process_stat
from tests.elastic.train.test_world_of_one import REPO, plain_env, run_script


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[Path]:
    """A node-local root of this test's own in the real /dev/shm (else in the temporary directory)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    root = base / f"etrain-test-{uuid.uuid4().hex[:12]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, **extra: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=plain_env(**extra), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _worker(
    tmp_path: Path, name: str, root: Path, **extra: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-m", "tests.elastic.train._plain_script", (tmp_path / name).as_uri(), "100000", "slow"]
    return _process(
        cmd, tmp_path / f"{name}.log", ETRAIN_LOCAL_SNAPSHOT_DIR=str(root), ETRAIN_LOCAL_SNAPSHOT_EVERY="1", **extra
    )


def _wait_for_snapshot(job_dir: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120  # a cold torch import, under the parallel suite's load
    while not any(job_dir.glob("slot-*/step-*/manifest*")):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no node-local snapshot in {job_dir}: {log.read_text()}"
        time.sleep(0.1)


def _start_up(tmp_path: Path, root: Path) -> None:
    """A new worker's start-up on the node (a job of its own, no node-local snapshots): the clean-up path."""
    result = run_script((tmp_path / "starter").as_uri(), 1, ETRAIN_LOCAL_SNAPSHOT_DIR=str(root))
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(420)
def test_what_a_sigkilled_worker_left_in_dev_shm_goes_at_the_next_start_up_and_live_owners_files_stay(
    tmp_path: Path, shm_root: Path
) -> None:
    dirs = {name: local_tier_dir(shm_root, (tmp_path / name).as_uri(), None) for name in ("dead", "live", "owned")}
    with (
        _process(["sleep", "600"], tmp_path / "agent.log") as agent,  # the job service's node agent of "owned"
        _worker(tmp_path, "dead", shm_root) as dead,
        _worker(tmp_path, "live", shm_root) as live,
        _worker(tmp_path, "owned", shm_root, ETRAIN_PREFORK_OWNER=str(agent.pid)) as owned,
    ):
        for name, proc in (("dead", dead), ("live", live), ("owned", owned)):
            _wait_for_snapshot(dirs[name], proc, tmp_path / f"{name}.log")
        for proc in (dead, owned):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert dirs["dead"].is_dir()  # before: it stayed in memory for good
        _start_up(tmp_path, shm_root)
        assert not dirs["dead"].exists()
        assert dirs["live"].is_dir() and any(dirs["live"].glob("slot-*/step-*"))  # its writer runs
        assert dirs["owned"].is_dir() and any(dirs["owned"].glob("slot-*/step-*"))  # its worker died, its agent runs
        assert live.poll() is None, (tmp_path / "live.log").read_text()
        agent.kill()
        agent.wait()
        live.send_signal(signal.SIGKILL)
        live.wait()
        _start_up(tmp_path, shm_root)
    assert sorted(p.name for p in shm_root.iterdir()) == []  # nothing of theirs is left, no .trash either


@pytest.mark.timeout(60)
def test_a_held_job_directory_is_never_swept_and_an_abandoned_one_of_a_dead_owner_is(tmp_path: Path) -> None:
    root = tmp_path / "root"
    claim = claim_job_dir(root / "held")
    (root / "held" / "slot-0").mkdir()
    assert (root / "held" / OWNERS).read_text().split() == [str(n) for n in owner_processes()[0]]
    with subprocess.Popen(["true"]) as gone:
        gone.wait()
    (root / "held" / OWNERS).write_text(f"{gone.pid} 1\n")  # a dead owner's record: the holder alone keeps it
    assert sweep(root) == []
    claim.release()
    assert sweep(root) == [root / "held"]
    assert sorted(p.name for p in root.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_reused_pid_is_no_owner_and_a_running_one_keeps_its_directory_until_it_ends(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with _process(["sleep", "60"], tmp_path / "owner.log") as owner:
        st = process_stat(owner.pid)
        assert st is not None
        for name, record in (("running", f"{owner.pid} {st[1]}"), ("reused", f"{owner.pid} {st[1] + 1}")):
            claim_job_dir(root / name).release()
            (root / name / OWNERS).write_text(record + "\n")
        assert sweep(root) == [root / "reused"]  # same pid, another start time: not its owner
        assert sweep(root, keep=root / "running") == []
        owner.kill()
        owner.wait()
    assert sweep(root, keep=root / "running") == []  # the caller's own job: left to its restore
    assert sweep(root) == [root / "running"]
