"""SnapshotTiers in one process (a gloo group of one): which tier a restore picks, slots, clean-up.

The multi-process behaviour (a restarted worker group and the survivors of a lost node resuming from
node-local snapshots under real torchrun) is in tests/integration/test_local_snapshots.py.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.state import TrainingState
from elastic.checkpoint.tiers import (
    LOCAL_OPTIONS,
    LocalSnapshotStats,
    SnapshotTiers,
    create_snapshot_tiers,
    local_tier_dir,
)
from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.trainer import ElasticConfig

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("gloo_world_1")]  # tests/conftest.py
CPU = torch.device("cpu")


def _state(step: int) -> TrainingState:
    return TrainingState(step=step, model={"w": torch.full((4,), float(step))}, data_cursor={"position": step})


def _tiers(tmp: Path, durable: bool = True) -> SnapshotTiers:
    manager = create_checkpoint_manager(str(tmp / "durable"), CheckpointOptions()) if durable else None
    return SnapshotTiers(manager, tmp / "local", 1, CPU)


def _save(tiers: SnapshotTiers, step: int, durable: bool) -> None:
    if durable:
        assert tiers.durable is not None
        tiers.durable.save(step, _state(step), blocking=True)
    else:
        tiers.save_local(step, lambda: _state(step), overlap_with=None)
        tiers.close()  # flushes the local write


def test_restore_prefers_a_newer_node_local_snapshot_over_the_durable_one(tmp_path: Path) -> None:
    _save(_tiers(tmp_path), 10, durable=True)
    _save(_tiers(tmp_path), 13, durable=False)
    state = _tiers(tmp_path).restore()
    assert state is not None and state.step == 13
    assert torch.equal(state.model["w"], torch.full((4,), 13.0))


def test_restore_takes_the_durable_snapshot_when_it_is_newer(tmp_path: Path) -> None:
    _save(_tiers(tmp_path), 7, durable=False)
    _save(_tiers(tmp_path), 10, durable=True)
    state = _tiers(tmp_path).restore()
    assert state is not None and state.step == 10


def test_a_corrupt_local_snapshot_falls_back_to_the_durable_one_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(_tiers(tmp_path), 10, durable=True)
    _save(_tiers(tmp_path), 13, durable=False)
    slots = (tmp_path / "local").glob("slot-*/**/*")  # the snapshot's files (not the job directory's .owners)
    data = [p for p in slots if p.is_file() and "manifest" not in p.name and p.stat().st_size]
    assert data, list((tmp_path / "local").rglob("*"))
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
        state = _tiers(tmp_path).restore()
    assert state is not None and state.step == 10
    assert "node-local snapshot step 13 is unusable" in caplog.text


def test_local_snapshots_alone_resume_a_job_without_durable_storage(tmp_path: Path) -> None:
    _save(_tiers(tmp_path, durable=False), 3, durable=False)
    state = _tiers(tmp_path, durable=False).restore()
    assert state is not None and state.step == 3
    assert _tiers(tmp_path / "empty", durable=False).restore() is None


def test_live_writers_hold_distinct_slots_and_a_dead_writers_slot_is_reused(tmp_path: Path) -> None:
    first, second = _tiers(tmp_path), _tiers(tmp_path)  # two agents on one host
    assert first._local is not None and second._local is not None
    assert Path(first._local.url).name == "slot-0" and Path(second._local.url).name == "slot-1"
    first.close()  # its worker died: the lock is gone
    third = _tiers(tmp_path)
    assert third._local is not None and Path(third._local.url).name == "slot-0"
    second.close()
    third.close()


def test_after_a_restore_only_slots_nobody_holds_are_deleted(tmp_path: Path) -> None:
    dead = _tiers(tmp_path)
    _save(dead, 5, durable=False)  # slot-0, lock released by close
    live = _tiers(tmp_path)  # takes slot-0 again
    other = _tiers(tmp_path)  # slot-1, held
    other.save_local(6, lambda: _state(6), overlap_with=None)
    assert other._local is not None
    other._local.wait()
    stale = tmp_path / "local" / "slot-2"
    manager = create_checkpoint_manager(str(stale), LOCAL_OPTIONS)
    manager.save(4, _state(4), blocking=True)
    manager.close()
    state = live.restore()
    assert state is not None and state.step == 6
    assert not stale.exists()
    assert (tmp_path / "local" / "slot-1").exists()
    other.close()
    live.close()


def test_close_of_a_finished_job_deletes_the_node_local_snapshots_and_a_stopped_one_keeps_them(
    tmp_path: Path,
) -> None:
    kept = _tiers(tmp_path)
    kept.save_local(2, lambda: _state(2), overlap_with=None)
    kept.close(finished=False)
    assert any((tmp_path / "local").rglob("manifest*"))
    done = _tiers(tmp_path)
    done.close(finished=True)
    assert not (tmp_path / "local").exists()


def test_the_local_tier_is_keyed_by_durable_url_and_job_so_a_new_job_never_resumes_an_old_ones_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = local_tier_dir(tmp_path, "s3://bucket/ck", "job-1")
    assert a == local_tier_dir(tmp_path, "s3://bucket/ck", "job-1")
    assert a != local_tier_dir(tmp_path, "s3://bucket/ck", "job-2")  # same URL, a new job
    assert a != local_tier_dir(tmp_path, "s3://bucket/other", "job-1")
    monkeypatch.setenv("ETRAIN_LOCAL_SNAPSHOT_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gen-1")  # the service's job id outlives torchrun generations
    monkeypatch.setenv("ETRAIN_JOB_ID", "job-1")
    first = create_snapshot_tiers(None, 1, CPU)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gen-2")
    second = create_snapshot_tiers(None, 1, CPU)
    assert first._dir == second._dir == local_tier_dir(tmp_path, None, "job-1")
    first.close()
    second.close()


def test_local_every_steps_comes_from_the_environment_and_rejects_junk(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ElasticConfig(LRPolicy(LRRule.LINEAR, 0.1, 1, 8))
    monkeypatch.setenv("ETRAIN_LOCAL_SNAPSHOT_EVERY", "2")
    assert config.resolved_local_every_steps() == 2
    monkeypatch.setenv("ETRAIN_LOCAL_SNAPSHOT_EVERY", "0")
    assert config.resolved_local_every_steps() is None
    monkeypatch.setenv("ETRAIN_LOCAL_SNAPSHOT_EVERY", "often")
    with pytest.raises(ValueError, match="ETRAIN_LOCAL_SNAPSHOT_EVERY"):
        config.resolved_local_every_steps()
    with pytest.raises(ValueError, match="local_every_steps"):
        SnapshotTiers(None, Path("/nonexistent"), 0, CPU)


def test_local_snapshots_come_every_n_steps_and_no_more_often_than_their_cost_allows(tmp_path: Path) -> None:
    every2 = SnapshotTiers(None, tmp_path / "a", 2, CPU)
    taken = []
    for step in range(1, 7):
        if every2.want_local(step):
            every2.save_local(step, lambda: _state(1), None)
            taken.append(step)
    assert taken == [2, 4, 6]
    every2.close()
    capped = SnapshotTiers(None, tmp_path / "b", 1, CPU, max_overhead=0.01)

    def slow() -> TrainingState:
        time.sleep(0.02)  # a 20 ms capture at a 1 % cap: the next one no sooner than 2 s later
        return _state(1)

    assert capped.want_local(1)
    capped.save_local(1, slow, None)
    assert not capped.want_local(2) and not capped.want_local(50)
    capped.note_durable(50)
    assert not capped.want_local(51)
    capped.close()


# -- the local tier's directory is private (a planted or readable one turns the tier off) -------------------
NOBODY = 65534


def _plant(slot: Path, step: int) -> None:
    """What another local user could leave in a directory they can write: a slot with a huge step."""
    manager = create_checkpoint_manager(str(slot), LOCAL_OPTIONS)
    manager.save(step, _state(step), blocking=True)
    manager.close()


@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_a_local_tier_dir_others_can_write_or_read_turns_the_local_tier_off_and_durable_snapshots_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    os.chmod(local, mode)
    _plant(local / "slot-9", 10**9)  # would be resumed from, and make retention delete the real slots
    _save(_tiers(tmp_path), 10, durable=True)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
        tiers = _tiers(tmp_path)
    assert f"refusing runtime directory {local}" in caplog.text and f"mode 0o{mode:03o}" in caplog.text
    assert "node-local snapshots off" in caplog.text
    state = tiers.restore()
    assert state is not None and state.step == 10 and tiers.source == "durable"
    assert not tiers.want_local(11)
    tiers.save_local(11, lambda: _state(11), overlap_with=None)  # a no-op, not an error
    tiers.close(finished=True)
    assert (local / "slot-9").exists() and stat.S_IMODE(local.stat().st_mode) == mode  # nothing of theirs touched


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_local_tier_dir_owned_by_another_user_turns_the_local_tier_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "shm"  # as /dev/shm/etrain-<uid> pre-created by someone else
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
        tiers = SnapshotTiers(None, root / "job", 1, CPU)
    assert f"owned by uid {NOBODY}" in caplog.text and tiers._local is None
    assert not (root / "job").exists()
    tiers.close()


def test_a_symlinked_local_tier_dir_turns_the_local_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "local").symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
        tiers = _tiers(tmp_path)
    assert "a symlink" in caplog.text and tiers._local is None
    assert not list((tmp_path / "elsewhere").iterdir())
    tiers.close()


def test_node_local_snapshot_files_are_0600_and_their_dirs_0700_under_the_usual_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = os.umask(0o022)
    try:
        monkeypatch.setenv("ETRAIN_LOCAL_SNAPSHOT_DIR", str(tmp_path / "fresh" / "root"))
        tiers = create_snapshot_tiers(None, 1, CPU)
        tiers.save_local(3, lambda: _state(3), overlap_with=None)
        tiers.close()
    finally:
        os.umask(old)
    made = list((tmp_path / "fresh").rglob("*"))
    files = [p for p in made if p.is_file()]
    assert any("manifest" in p.name for p in files) and len(files) > 2, made
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: "0o600" for p in files}
    dirs = [tmp_path / "fresh", *(p for p in made if p.is_dir())]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {str(p): "0o700" for p in dirs}


# -- a local write slower than the steps: skipped, counted, logged --------------------------------------------
class _Gate:
    """A value of the state that the writer thread pickles: holds that write until ``open`` is set (or fails it)."""

    def __init__(self, fail: bool = False) -> None:
        self.open, self.fail = threading.Event(), fail

    def __deepcopy__(self, memo: dict[int, Any]) -> _Gate:
        return self  # the save's copy of the state holds this gate: the writer thread's pickling waits on it

    def __reduce__(self) -> tuple[Any, ...]:
        assert self.open.wait(30)
        if self.fail:
            raise OSError("the node's memory is full")
        return (int, (0,))


def _gated(step: int, gate: _Gate) -> dict[str, Any]:
    return {**_state(step).to_dict(), "gate": gate}


def _wait_written(tiers: SnapshotTiers) -> None:
    deadline = time.monotonic() + 30
    while tiers.in_flight:
        assert time.monotonic() < deadline, "the local write never finished"
        time.sleep(0.01)


def test_local_snapshots_due_while_the_last_is_still_written_are_skipped_counted_and_logged_sparingly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = SnapshotTiers(None, tmp_path / "local", 1, CPU)
    gate = _Gate()
    tiers.save_local(1, lambda: _gated(1, gate), None)
    assert tiers.in_flight
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
        for step in (2, 3, 4):
            tiers.save_local(step, lambda step=step: _state(step), None)
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skips) == 2, skips  # the 1st and the 2nd skip; the 3rd is the next power of two's
    assert "step 2 skipped" in skips[0] and "(1 skipped, 1 written so far)" in skips[0]
    assert "step 3 skipped" in skips[1] and "local_every_steps=1" in skips[1]
    gate.open.set()
    _wait_written(tiers)
    tiers.save_local(5, lambda: _state(5), None)
    tiers.close()
    assert tiers.local_stats == LocalSnapshotStats(saved=2, skipped=3, failed=0, last_skipped_step=4)
    assert tiers.local_stats.progress_fields() == {
        "local_snapshots_saved": 2,
        "local_snapshots_skipped": 3,
        "local_snapshots_failed": 0,
    }
    restored = SnapshotTiers(None, tmp_path / "local", 1, CPU).restore()
    assert restored is not None and restored.step == 5  # skipped steps cost nothing of what was written


def test_a_failed_local_write_is_counted_and_warned_about_once_and_the_next_ones_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = SnapshotTiers(None, tmp_path / "local", 1, CPU)
    for step in (1, 3):
        gate = _Gate(fail=True)
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.tiers"):
            tiers.save_local(step, lambda step=step, gate=gate: _gated(step, gate), None)
            gate.open.set()
            _wait_written(tiers)
            tiers.save_local(step + 1, lambda step=step: _state(step + 1), None)  # raises the failure: not taken
    _wait_written(tiers)
    tiers.save_local(5, lambda: _state(5), None)
    tiers.close()
    warnings = [r.getMessage() for r in caplog.records if "failing" in r.getMessage()]
    assert len(warnings) == 1 and "node-local snapshots failing" in warnings[0]
    assert "the node's memory is full" in warnings[0]
    assert tiers.local_stats == LocalSnapshotStats(saved=3, skipped=0, failed=2)
    restored = SnapshotTiers(None, tmp_path / "local", 1, CPU).restore()
    assert restored is not None and restored.step == 5


def test_ranks_that_write_no_local_snapshot_count_none(tmp_path: Path) -> None:
    tiers = SnapshotTiers(None, None, None, CPU)
    tiers.save_local(1, lambda: _state(1), None)
    assert tiers.local_stats == LocalSnapshotStats()
