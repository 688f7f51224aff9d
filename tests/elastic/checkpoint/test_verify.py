"""Verification before resume, fallback to the previous good snapshot, retention and garbage removal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointCorruptError, CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.layout import step_dir
from tests.elastic.checkpoint._helpers import assert_same, flip_byte, make_state
from tests.elastic.checkpoint.conftest import Target

SMALL = {"rows": 64, "cols": 32}


def save_steps(url: str, steps: list[int], **options: object) -> None:
    with create_checkpoint_manager(url, CheckpointOptions(**options)) as mgr:  # type: ignore[arg-type]
        for step in steps:
            mgr.save(step, make_state(step, **SMALL))


def data_file(root: Path, step: int, name: str = "tensors-00000.bin") -> Path:
    (path,) = (root / step_dir(step)).glob(f"*/{name}")
    return path


def unusable_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "unusable" in r.getMessage()]


def test_corrupted_byte_falls_back_to_previous_snapshot_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_steps(str(tmp_path), [1, 2])
    flip_byte(data_file(tmp_path, 2))
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path)) as mgr:
        assert mgr.latest_step() == 2  # committed, but its data no longer verifies
        snap = mgr.load_latest()
        with pytest.raises(CheckpointCorruptError, match="blake3 mismatch"):
            mgr.load(2)
    assert snap is not None and snap.step == 1
    assert_same(snap.state, make_state(1, **SMALL))
    (warning,) = unusable_warnings(caplog)
    assert "step 2" in warning and "blake3 mismatch" in warning and "previous snapshot" in warning


def test_corrupted_byte_on_s3_falls_back_too(s3_target: Target, caplog: pytest.LogCaptureFixture) -> None:
    import fsspec

    save_steps(s3_target.url, [1, 2], storage_options=s3_target.storage_options)
    fs = fsspec.filesystem("s3", **s3_target.storage_options)
    (path,) = fs.glob(f"{s3_target.url}/{step_dir(2)}/*/skeleton.pt")
    data = bytearray(fs.cat_file(path))
    data[len(data) // 3] ^= 0x01
    fs.pipe_file(path, bytes(data))
    with (
        caplog.at_level(logging.WARNING),
        create_checkpoint_manager(s3_target.url, CheckpointOptions(storage_options=s3_target.storage_options)) as mgr,
    ):
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    assert "blake3 mismatch in" in unusable_warnings(caplog)[0]


def test_truncated_or_missing_data_is_skipped_by_size_check(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(str(tmp_path), [1, 2, 3])
    data_file(tmp_path, 3).write_bytes(data_file(tmp_path, 3).read_bytes()[:-100])
    data_file(tmp_path, 2, "skeleton.pt").unlink()
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path)) as mgr:
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    warnings = unusable_warnings(caplog)
    assert "step 3" in warnings[0] and "manifest says" in warnings[0]
    assert "step 2" in warnings[1] and "missing" in warnings[1]


def test_snapshot_with_torn_manifest_does_not_exist(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(str(tmp_path), [1, 2])
    manifest = tmp_path / step_dir(2) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path)) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [1]
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    assert "invalid manifest" in unusable_warnings(caplog)[0]


def test_nothing_valid_means_start_fresh_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / step_dir(4) / "deadbeefdeadbeef").mkdir(parents=True)  # an attempt that never committed
    with caplog.at_level(logging.INFO), create_checkpoint_manager(str(tmp_path)) as mgr:
        assert mgr.load_latest() is None
        assert mgr.load_latest() is None
        assert mgr.latest_step() is None
    fresh = [r for r in caplog.records if "starting fresh" in r.getMessage()]
    assert len(fresh) == 1 and not unusable_warnings(caplog)


def test_retention_keeps_last_k_and_every_nth(tmp_path: Path) -> None:
    save_steps(str(tmp_path), [10, 20, 30, 40, 50, 60, 70], keep_last=2, keep_every=30)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [30, 60, 70]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(30), step_dir(60), step_dir(70)]


def test_retention_keeps_older_good_snapshot_when_a_newer_one_is_corrupt(tmp_path: Path) -> None:
    save_steps(str(tmp_path), [100, 200], keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [step_dir(200)]
    flip_byte(data_file(tmp_path, 200))
    # resume finds nothing valid at 200; a run that saves 150 (older than 200) keeps 200 untouched
    save_steps(str(tmp_path), [150], keep_last=1)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [150, 200]
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 150


def test_save_removes_dead_attempts_and_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save_steps(str(tmp_path), [1])
    (tmp_path / step_dir(1) / "aaaaaaaaaaaaaaaa").mkdir()  # a dead attempt at the same step
    (tmp_path / step_dir(1) / "manifest.json.tmp-123").write_text("{")
    (tmp_path / step_dir(2) / "bbbbbbbbbbbbbbbb").mkdir(parents=True)  # a dead attempt, never committed
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        state = make_state(3, **SMALL)
        mgr.save(1, state, blocking=True)  # same step again: the new attempt replaces the old one
        mgr.save(3, make_state(3, **SMALL), blocking=True)
        snap = mgr.load(1)
    assert_same(snap.state, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(1), step_dir(3)]
    assert sorted(p.name for p in (tmp_path / step_dir(1)).iterdir()) == sorted(["manifest.json", snap.manifest.token])
