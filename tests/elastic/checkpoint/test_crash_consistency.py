"""SIGKILL a real writer process at many points of a save: every later load is a complete earlier snapshot."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointOptions, create_checkpoint_manager
from elastic.checkpoint.layout import step_dir
from tests.elastic.checkpoint._helpers import assert_same, make_state
from tests.elastic.checkpoint.conftest import Target

REPO = Path(__file__).resolve().parents[3]


def _env(marker: Path, pause_at: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_MARKER=str(marker), AWS_EC2_METADATA_DISABLED="true")
    if pause_at:
        env["CKPT_PAUSE_AT"] = pause_at
    return env


def _start(target: Target, mode: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    options = dict(target.storage_options)
    if target.kind == "s3":
        options["default_block_size"] = 5 * 2**20  # multipart upload in 5 MiB parts: kills land mid-upload
    cmd = [
        sys.executable,
        "-m",
        "tests.elastic.checkpoint._crash_writer",
        target.url,
        json.dumps(options),
        mode,
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if proc.poll() is not None:
            output = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"writer exited with {proc.returncode} before the kill point:\n{output[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"writer did not reach the kill point within {timeout}s")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


def _assert_complete_snapshot(target: Target, allowed: set[int], caplog: pytest.LogCaptureFixture) -> int:
    options = CheckpointOptions(storage_options=target.storage_options)
    caplog.clear()
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(target.url, options) as mgr:
        snap = mgr.load_latest()
    assert snap is not None, "no snapshot survived"
    assert snap.step in allowed, f"loaded step {snap.step}, expected one of {sorted(allowed)}"
    assert_same(snap.state, make_state(snap.step, *_shape(snap.state)))
    unusable = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert not unusable, f"a torn save was visible as a snapshot: {unusable}"
    return snap.step


def _shape(state: object) -> tuple[int, int]:
    weight = state["model"]["weight"]  # type: ignore[index]
    return int(weight.shape[0]), int(weight.shape[1])


# (event:count, step that must be loaded afterwards)
LOCAL_POINTS = [
    ("save_begin:1", 1),  # nothing written yet
    ("data_begin:1", 1),  # attempt directory exists, empty
    ("data_chunk:1", 1),  # first chunk of data written (the skeleton or 1 MiB of tensors-00000.bin)
    ("data_chunk:7", 1),  # mid-segment
    ("data_done:1", 1),  # all data durable, no manifest
    ("publish_tmp_written:1", 1),  # manifest written to its temp name, not renamed
    ("manifest_committed:1", 2),  # committed, not yet verified nor cleaned up
    ("snapshot_uncommitted:1", 2),  # retention removed step 1's manifest, its data still there
]
S3_POINTS = [
    ("data_chunk:7", 1),  # multipart upload of tensors-00000.bin in progress (one 5 MiB part sent)
    ("manifest_begin:1", 1),  # data objects complete, manifest PUT not sent
    ("manifest_committed:1", 2),
]


def _kill_at(target: Target, point: str, expected: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "marker"
    proc = _start(target, "pause", _env(marker, point))
    try:
        assert _wait_for(marker, proc) == point.split(":")[0]
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_complete_snapshot(target, {expected}, caplog)
    # a new run saves over the debris: dead attempts go away, the new snapshot is the latest
    options = CheckpointOptions(storage_options=target.storage_options, keep_last=1)
    with create_checkpoint_manager(target.url, options) as mgr:
        mgr.save(3, make_state(3, 8, 8), blocking=True)
        assert [s.step for s in mgr.list_snapshots()] == [3]
        assert mgr.storage.list_children("") == [step_dir(3)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("point", "expected"), LOCAL_POINTS, ids=[p for p, _ in LOCAL_POINTS])
def test_kill_during_local_save_leaves_previous_or_new_complete_snapshot(
    point: str, expected: int, local_target: Target, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _kill_at(local_target, point, expected, tmp_path, caplog)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("point", "expected"), S3_POINTS, ids=[p for p, _ in S3_POINTS])
def test_kill_during_s3_save_leaves_previous_or_new_complete_snapshot(
    point: str, expected: int, s3_target: Target, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _kill_at(s3_target, point, expected, tmp_path, caplog)


@pytest.mark.timeout(180)
def test_kill_after_random_delays_during_back_to_back_saves(
    local_target: Target, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(20240611)
    marker = tmp_path / "committed"
    last_loaded = 0
    for _ in range(4):
        proc = _start(local_target, "loop", _env(marker))
        try:
            _wait_for(marker, proc)  # at least one save of this run committed
            time.sleep(rng.uniform(0.0, 0.6))
            _kill(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reported = [int(s) for s in marker.read_text().split()]
        # the newest reported commit or a later one whose commit was not yet reported
        loaded = _assert_complete_snapshot(local_target, set(range(max(reported), max(reported) + 3)), caplog)
        assert loaded >= last_loaded
        last_loaded = loaded
        marker.unlink()
