"""Start-up checks give one clear line for each storage misconfiguration; Lustre striping via ``lfs``."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from elastic.checkpoint import CheckpointOptions, CheckpointStorageError, create_checkpoint_manager
from elastic.testing.s3_server import LocalS3Server
from tests.elastic.checkpoint._helpers import make_state
from tests.elastic.checkpoint.conftest import Target


def start_up_error(url: str, options: CheckpointOptions | None = None) -> str:
    with pytest.raises(CheckpointStorageError) as info:
        create_checkpoint_manager(url, options).check_storage()
    message = str(info.value)
    assert "\n" not in message, "the start-up error must be one line"
    return message


def test_unknown_url_scheme_is_refused_before_anything_runs() -> None:
    message = start_up_error("nosuchfs://bucket/run")
    assert "nosuchfs://bucket/run" in message and "Protocol not known" in message


def test_empty_url_is_refused() -> None:
    assert "empty" in start_up_error("  ")


def test_missing_bucket_is_named(s3_server: LocalS3Server) -> None:
    options = CheckpointOptions(storage_options=s3_server.storage_options())
    message = start_up_error("s3://no-such-bucket-here/run", options)
    assert message.startswith(
        "checkpoint storage s3://no-such-bucket-here/run is not usable: the bucket does not exist"
    )


def test_missing_credentials_are_named(s3_target: Target) -> None:
    no_keys = {"client_kwargs": s3_target.storage_options["client_kwargs"], "skip_instance_cache": True}
    message = start_up_error(s3_target.url, CheckpointOptions(storage_options=no_keys))
    assert "no credentials found" in message and "AWS_ACCESS_KEY_ID" in message


def test_unreachable_s3_endpoint_is_named() -> None:
    options = CheckpointOptions(
        storage_options={
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},  # discard port: nothing listens
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        }
    )
    assert "cannot connect" in start_up_error("s3://bucket/run", options)


def test_read_only_path_is_named() -> None:
    read_only = Path("/sys/kernel/elastic-train-checkpoints")  # sysfs refuses new entries, even to root
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    assert "not writable (permission denied or read-only)" in start_up_error(str(read_only))


def test_path_below_a_regular_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "not a directory" in start_up_error(str(tmp_path / "file" / "ckpt"))


def test_usable_storage_passes_and_leaves_no_probe_behind(target: Target) -> None:
    with create_checkpoint_manager(target.url, CheckpointOptions(storage_options=target.storage_options)) as mgr:
        mgr.check_storage()
        assert mgr.storage.list_sizes("") == {}


@pytest.fixture
def recording_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``lfs`` executable on PATH that records its arguments (exit status from ``LFS_EXIT``)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "lfs.log"
    script = bindir / "lfs"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "lfs: simulated" >&2\nexit ${{LFS_EXIT:-0}}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_lustre_root_is_striped_once_with_configured_layout(recording_lfs: Path, tmp_path: Path) -> None:
    root = tmp_path / "lustre" / "job"
    options = CheckpointOptions(lustre_stripe_count=8, lustre_stripe_size="16M")
    with create_checkpoint_manager(str(root), options) as mgr:
        mgr.check_storage()
        mgr.save(1, make_state(1, 8, 8), blocking=True)
        mgr.save(2, make_state(2, 8, 8), blocking=True)
    assert recording_lfs.read_text().splitlines() == [f"setstripe -c 8 -S 16M {root}"]


def test_failing_lfs_only_warns(
    recording_lfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LFS_EXIT", "22")
    with caplog.at_level(logging.WARNING), create_checkpoint_manager(str(tmp_path / "ckpt")) as mgr:
        mgr.check_storage()
    assert recording_lfs.read_text().startswith("setstripe -c 4 -S 4M ")
    assert any("exited 22" in r.getMessage() and "simulated" in r.getMessage() for r in caplog.records)


def test_striping_can_be_turned_off_and_never_applies_to_object_stores(
    recording_lfs: Path, tmp_path: Path, s3_target: Target
) -> None:
    create_checkpoint_manager(str(tmp_path / "a"), CheckpointOptions(lustre_striping=False)).check_storage()
    create_checkpoint_manager(
        s3_target.url, CheckpointOptions(storage_options=s3_target.storage_options)
    ).check_storage()
    assert not recording_lfs.exists()
