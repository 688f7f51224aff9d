"""The node-local tier logs its per-snapshot lines at DEBUG, durable snapshots' lines stay INFO, warnings stay
warnings (elastic/checkpoint/quiet_logs.py). One process, a gloo group of one (tests/conftest.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.quiet_logs import quieted
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.tiers import SnapshotTiers

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("gloo_world_1")]


def _state(step: int) -> TrainingState:
    return TrainingState(step=step, model={"w": torch.full((4,), float(step))}, data_cursor={"position": step})


def _run_tiers(tmp_path: Path) -> None:
    """Four node-local snapshots (each written before the next), then a durable one."""
    durable = create_checkpoint_manager(str(tmp_path / "durable"), CheckpointOptions())
    tiers = SnapshotTiers(durable, tmp_path / "local", 1, torch.device("cpu"))
    for step in range(1, 5):
        tiers.save_local(step, lambda step=step: _state(step), overlap_with=None)
        deadline = time.monotonic() + 30
        while tiers.in_flight:
            assert time.monotonic() < deadline, "the local write never finished"
            time.sleep(0.01)
    durable.save(5, _state(5), blocking=True)
    tiers.close()


def test_node_local_snapshots_log_no_info_line_and_durable_ones_still_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = str(tmp_path / "local")
    with caplog.at_level(logging.INFO):
        _run_tiers(tmp_path)
    about_local = [r for r in caplog.records if local in r.getMessage()]
    assert about_local == [], [r.getMessage() for r in about_local]  # 4 commits, 3 retentions, a probe before
    durable = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("checkpoint step 5 committed at" in m and "durable" in m for m in durable), durable
    assert not [url for url in quieted() if url.startswith(local)]  # close() let go of the slot's URL


def test_with_debug_on_the_node_local_snapshots_lines_are_there_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = str(tmp_path / "local")
    with caplog.at_level(logging.DEBUG):
        _run_tiers(tmp_path)
    about_local = [r for r in caplog.records if local in r.getMessage()]
    commits = [r for r in about_local if "committed at" in r.getMessage()]
    assert len(commits) == 4, [r.getMessage() for r in about_local]
    assert any("retention removed step(s) 3" in r.getMessage() for r in about_local)
    assert {r.levelname for r in about_local} == {"DEBUG"}


def test_a_warning_about_a_node_local_slot_stays_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiers = SnapshotTiers(None, tmp_path / "local", 1, torch.device("cpu"))
    (slot,) = [url for url in quieted() if url.startswith(str(tmp_path))]  # tiers other tests left open are there
    with caplog.at_level(logging.INFO):
        logging.getLogger("elastic.checkpoint.manager").warning("cannot list %s", slot)
    tiers.close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", f"cannot list {slot}")]
