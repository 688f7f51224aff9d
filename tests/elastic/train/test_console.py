"""The loop's INFO lines reach the console of a script that configures no logging, once each, also when the script
configures logging after building the trainer (elastic/train/console.py). Real interpreters running a user-like
script (tests/elastic/train/_plain_script.py) without torchrun."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.elastic.train.test_world_of_one import run_script

STEP_LINE = re.compile(r"step (\d+) epoch 0 loss")


def step_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if STEP_LINE.search(line)]


@pytest.mark.timeout(300)
def test_a_script_that_configures_no_logging_shows_the_loops_info_lines_on_stderr_with_the_rank(tmp_path: Path) -> None:
    result = run_script((tmp_path / "ckpt").as_uri(), 3)
    assert result.returncode == 0, result.stderr
    lines = step_lines(result.stderr)
    assert [STEP_LINE.search(line)[1] for line in lines] == ["1", "2", "3"], result.stderr  # type: ignore[index]
    assert all(re.match(r"\d\d:\d\d:\d\d rank 0 INFO elastic\.train\.trainer: step", line) for line in lines), lines
    assert "step" not in result.stdout.replace("start step", "").replace("end step", "")  # stderr, not stdout


@pytest.mark.timeout(300)
def test_logging_configured_after_the_trainer_prints_each_line_once_in_the_scripts_format(tmp_path: Path) -> None:
    result = run_script((tmp_path / "ckpt").as_uri(), 3, "basic-after")
    assert result.returncode == 0, result.stderr
    lines = step_lines(result.stderr)
    assert len(lines) == 3, result.stderr  # not 6: our handler steps aside once the root logger has one
    assert all(line.startswith("USER elastic.train.trainer: step") for line in lines), lines
    said = [line for line in result.stderr.splitlines() if "training as a world of one process" in line]
    assert len(said) == 1 and " rank 0 INFO " in said[0], result.stderr  # logged before basicConfig: ours


@pytest.mark.timeout(300)
def test_a_second_trainer_in_the_same_process_adds_no_second_handler(tmp_path: Path) -> None:
    result = run_script((tmp_path / "ckpt").as_uri(), 2, "twice")
    assert result.returncode == 0, result.stderr
    counts = Counter(STEP_LINE.search(line)[1] for line in step_lines(result.stderr))  # type: ignore[index]
    assert counts == {"1": 1, "2": 1, "3": 1, "4": 1}, result.stderr  # the second resumed at step 2
    assert result.stderr.count("training as a world of one process") == 2  # one per trainer, each once
