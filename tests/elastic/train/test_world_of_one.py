"""``python train.py`` without torchrun: the trainer trains as a world of one and resumes from its snapshots; a
half-set launcher environment is one clear error, not torch's ``env://`` error or a hang.

Each test runs a real interpreter on a user-like script (tests/elastic/train/_plain_script.py), without torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.contract import env as contract
from elastic.contract.env import TorchrunEnv, WorkerEnvError

REPO = Path(__file__).resolve().parents[3]
#: every variable a launcher may have left in the test's own environment (none may reach the plain script)
LAUNCHER = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    contract.LOCAL_SNAPSHOT_EVERY,
)


def plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER and not k.startswith(contract.PREFIX)}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def run_script(url: str, steps: int, mode: str = "plain", **extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tests.elastic.train._plain_script", url, str(steps), mode]
    # a hang guard only: the script imports torch cold (several CPU-s, more under the parallel suite's load)
    return subprocess.run(cmd, cwd=REPO, env=plain_env(**extra), capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_python_train_py_without_torchrun_trains_as_a_world_of_one_and_a_second_run_resumes(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()  # file:///...
    first = run_script(url, 4)  # snapshots every 2 steps: the 4th is saved
    assert first.returncode == 0, first.stderr
    assert "start step 0" in first.stdout and "end step 4" in first.stdout, first.stdout
    said = [line for line in first.stderr.splitlines() if "training as a world of one process" in line]
    assert len(said) == 1 and " INFO " in said[0], first.stderr
    second = run_script(url, 2)
    assert second.returncode == 0, second.stderr
    assert "start step 4" in second.stdout and "end step 6" in second.stdout, second.stdout
    assert "resumed from step 4" in second.stderr, second.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"RANK": "0"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "RANK, WORLD_SIZE"),
    ],
)
def test_a_half_set_launcher_environment_stops_at_once_naming_what_is_missing(
    tmp_path: Path, given: dict[str, str], missing: str
) -> None:
    result = run_script((tmp_path / "ckpt").as_uri(), 1, **given)
    assert result.returncode != 0
    assert f"set but not {missing}; run under torchrun" in result.stderr, result.stderr
    assert "expected, but not set" not in result.stderr  # torch's env:// error for the first one it misses


@pytest.mark.timeout(10)
def test_launched_is_false_with_none_of_torchruns_variables_true_with_env_inits_four_and_an_error_between() -> None:
    assert TorchrunEnv.launched({}) is False
    assert TorchrunEnv.launched({"RANK": "", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}) is False
    full = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"}
    assert TorchrunEnv.launched(full) is True  # LOCAL_RANK may be missing: torch's env:// does without it
    with pytest.raises(WorkerEnvError, match="LOCAL_RANK set but not RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        TorchrunEnv.launched({"LOCAL_RANK": "0"})
    with pytest.raises(WorkerEnvError, match="set but not MASTER_PORT"):
        TorchrunEnv.launched({k: v for k, v in full.items() if k != "MASTER_PORT"})
