"""Verification right after a save (``verify_after_write``, issue 29): each mode checks what it says it does,
``auto`` picks per storage kind, the former bools still work, bad settings are refused.

Damage is done from the save's own event hook, between the commit and the verification, on real files and a
real S3 server (moto)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic.checkpoint import (
    CheckpointOptions,
    CheckpointWriteError,
    VerifyMode,
    create_checkpoint_manager,
)
from elastic.checkpoint.filesystems import drop_cached_pages, filesystem_type, is_network_filesystem
from elastic.checkpoint.layout import step_dir
from elastic.checkpoint.storage import LocalStorage, create_storage
from tests.elastic.checkpoint._helpers import assert_same, make_state
from tests.elastic.checkpoint.conftest import Target

SMALL = {"rows": 64, "cols": 32}


def _segment(root: Path, step: int) -> Path:
    (path,) = (root / step_dir(step)).glob("*/tensors-00000.bin")
    return path


def _flip_on_disk(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 7)


def _damage_after_commit(root: Path, damage: Callable[[Path], None]) -> Callable[[str], None]:
    """An event hook that damages step 2's first segment once its manifest is committed (before verifying)."""

    def hook(name: str) -> None:
        if name == "manifest_committed" and (root / step_dir(2)).exists():
            damage(_segment(root, 2))

    return hook


def _save_1_then_damaged_2(root: Path, mode: str, damage: Callable[[Path], None]) -> None:
    """Save step 1 cleanly, then step 2 damaged between its commit and its verification (raises if caught)."""
    options = CheckpointOptions(verify_after_write=mode, keep_last=1)
    with create_checkpoint_manager(str(root), options) as mgr:
        mgr.save(1, make_state(1, **SMALL), blocking=True)
    with create_checkpoint_manager(str(root), options, events=_damage_after_commit(root, damage)) as mgr:
        mgr.save(2, make_state(2, **SMALL), blocking=True)


@pytest.mark.parametrize("mode", ["size", "read_back", "read_back_uncached", "auto"])
def test_a_file_truncated_after_writing_fails_the_save_and_keeps_the_older_snapshot(tmp_path: Path, mode: str) -> None:
    applied = "size" if mode == "auto" else mode  # auto on this machine's local file system
    with pytest.raises(CheckpointWriteError, match=f"failed verification \\({applied}\\) right after writing"):
        _save_1_then_damaged_2(tmp_path, mode, _truncate)
    with create_checkpoint_manager(str(tmp_path)) as mgr:  # retention (keep_last=1) did not run
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1
    assert_same(snap.state, make_state(1, **SMALL))


@pytest.mark.parametrize("mode", ["read_back", "read_back_uncached"])
def test_a_byte_flipped_on_disk_after_writing_is_caught_by_the_read_backs(tmp_path: Path, mode: str) -> None:
    with pytest.raises(CheckpointWriteError, match=f"\\({mode}\\) right after writing \\(blake3 mismatch in .*"):
        _save_1_then_damaged_2(tmp_path, mode, _flip_on_disk)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert [s.step for s in mgr.list_snapshots()] == [1, 2]  # 2 committed, failed verification: 1 kept


@pytest.mark.parametrize("mode", ["none", "size", "auto"])
def test_the_cheap_modes_do_not_read_back_and_the_load_still_catches_it(tmp_path: Path, mode: str) -> None:
    _save_1_then_damaged_2(tmp_path, mode, _flip_on_disk)  # the save succeeds: nothing re-read
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        snap = mgr.load_latest()  # loading always verifies every digest
    assert snap is None  # retention (keep_last=1) removed step 1 after the "verified" step 2: none left


def test_none_skips_even_the_size_check(tmp_path: Path) -> None:
    _save_1_then_damaged_2(tmp_path, "none", _truncate)
    with create_checkpoint_manager(str(tmp_path)) as mgr:
        assert mgr.load_latest() is None


def test_the_applied_mode_is_recorded_in_the_save_timings(tmp_path: Path) -> None:
    for mode, applied in (("auto", "size"), (True, "read_back"), (False, "none"), ("read_back_uncached", None)):
        with create_checkpoint_manager(str(tmp_path), CheckpointOptions(verify_after_write=mode)) as mgr:
            mgr.save(1, make_state(1, **SMALL), blocking=True)
            assert mgr.last_timings.verify_mode == (applied or mode)


def test_auto_on_s3_reads_back_from_the_store_and_catches_a_flipped_object(s3_target: Target) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_target.storage_options)

    def flip(name: str) -> None:
        if name != "manifest_committed":
            return
        for path in fs.glob(f"{s3_target.url}/{step_dir(2)}/*/tensors-00000.bin"):
            data = bytearray(fs.cat_file(path))
            data[len(data) // 2] ^= 0x5A
            fs.pipe_file(path, bytes(data))

    options = CheckpointOptions(storage_options=s3_target.storage_options)  # verify_after_write="auto"
    storage = create_storage(s3_target.url, s3_target.storage_options)
    assert storage.auto_verify_mode is VerifyMode.READ_BACK_UNCACHED
    with create_checkpoint_manager(s3_target.url, options) as mgr:
        mgr.save(1, make_state(1, **SMALL), blocking=True)
        assert mgr.last_timings.verify_mode == "read_back_uncached"
    with create_checkpoint_manager(s3_target.url, options, events=flip) as mgr:
        with pytest.raises(
            CheckpointWriteError, match="\\(read_back_uncached\\) right after writing \\(blake3 mismatch"
        ):
            mgr.save(2, make_state(2, **SMALL), blocking=True)
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 1


def test_auto_means_size_on_local_file_systems_and_in_memory(tmp_path: Path) -> None:
    kind = filesystem_type(tmp_path)
    assert kind is not None and filesystem_type("/proc/self") == "proc"
    local = LocalStorage(tmp_path)
    expected = VerifyMode.READ_BACK_UNCACHED if is_network_filesystem(kind) else VerifyMode.SIZE
    assert local.auto_verify_mode is expected
    assert local.resolve_verify_mode(VerifyMode.READ_BACK) is VerifyMode.READ_BACK
    assert create_storage("memory://verify-modes").auto_verify_mode is VerifyMode.SIZE
    if os.path.isdir("/dev/shm"):
        assert LocalStorage("/dev/shm").auto_verify_mode is VerifyMode.SIZE  # tmpfs: the medium is memory


@pytest.mark.parametrize(
    ("fs_type", "network"),
    [
        *[(kind, True) for kind in ("lustre", "nfs4", "nfs", "ceph", "fuse.sshfs", "gpfs")],
        *[(kind, False) for kind in ("ext4", "xfs", "tmpfs", "btrfs", "overlay", "unknown")],
    ],
)
def test_network_file_systems_are_told_from_local_ones(fs_type: str, network: bool) -> None:
    assert is_network_filesystem(fs_type) is network


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
def test_an_uncached_read_back_leaves_no_page_of_the_file_in_the_page_cache(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) == "tmpfs":
        pytest.skip("tmpfs: the page cache is the medium")
    storage = LocalStorage(tmp_path)
    payload = os.urandom(8 << 20)
    with storage.open_write("f.bin") as out:
        out.write(payload)
    with storage.open_read("f.bin") as f:
        assert f.read() == payload
    assert _resident_bytes(tmp_path / "f.bin") > 0  # an ordinary read is served from (and fills) the cache
    with storage.open_read_uncached("f.bin") as f:
        assert _resident_bytes(tmp_path / "f.bin") == 0  # dropped before the first byte is read
        assert f.read() == payload
    assert _resident_bytes(tmp_path / "f.bin") == 0  # and the read-back's pages are dropped again
    with open(tmp_path / "f.bin", "rb") as f:
        assert drop_cached_pages(f.fileno())


@pytest.mark.parametrize(
    ("value", "mode"),
    [(True, "read_back"), (False, "none"), ("auto", "auto"), ("SIZE", "size"), (VerifyMode.NONE, "none")],
)
def test_settings_old_bools_map_explicitly(value: object, mode: str) -> None:
    options = CheckpointOptions(verify_after_write=value)  # type: ignore[arg-type]
    assert options.verify_after_write is VerifyMode(mode) and options.verify_mode is VerifyMode(mode)
    assert CheckpointOptions.from_mapping({"verify_after_write": value}).verify_mode is VerifyMode(mode)


@pytest.mark.parametrize("value", ["sometimes", "", 1, None, "read-back"])
def test_bad_verify_settings_are_refused_naming_the_choices(value: object) -> None:
    with pytest.raises(
        ValueError, match="verify_after_write must be one of auto, none, size, read_back, read_back_unc"
    ):
        CheckpointOptions(verify_after_write=value)  # type: ignore[arg-type]
    assert CheckpointOptions().verify_after_write is VerifyMode.AUTO
