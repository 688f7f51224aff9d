"""elastic.runtime_dir.private_dir on real directories: what it creates, what it accepts, what it refuses."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.runtime_dir import UnsafeDirectoryError, private_dir

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o777])
def test_a_fresh_runtime_dir_and_the_parents_it_creates_are_0700_whatever_the_umask(
    tmp_path: Path, umask: None, mask: int
) -> None:
    os.umask(mask)
    target = tmp_path / "a" / "b" / "run"
    assert private_dir(target) == target
    for made in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_ISDIR(os.lstat(made).st_mode) and _mode(made) == 0o700, made
        assert os.lstat(made).st_uid == os.geteuid()


def test_an_existing_private_dir_of_ours_is_accepted_as_it_is(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir(mode=0o700)
    (target / "kept").write_text("x")
    assert private_dir(target) == target
    assert private_dir(target, create=False) == target
    assert (target / "kept").read_text() == "x" and _mode(target) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o750, 0o711, 0o1777])
def test_a_runtime_dir_others_may_read_write_or_enter_is_refused_naming_path_owner_and_mode(
    tmp_path: Path, mode: int
) -> None:
    target = tmp_path / "run"
    target.mkdir()
    os.chmod(target, mode)
    with pytest.raises(UnsafeDirectoryError) as refused:
        private_dir(target)
    message = str(refused.value)
    assert str(target) in message and f"owned by uid {os.geteuid()}" in message and f"mode 0o{mode:03o}" in message
    assert isinstance(refused.value, PermissionError)  # what callers that handle OSError already catch
    assert _mode(target) == mode  # refused, not silently "fixed": someone else may already hold it open


@as_root
def test_a_runtime_dir_owned_by_another_user_is_refused_even_with_mode_0700(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir(mode=0o700)
    os.chown(target, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError, match=f"{target} .*owned by uid {NOBODY}, mode 0o700.*another user"):
        private_dir(target)


def test_a_symlink_in_place_of_the_runtime_dir_is_refused_even_to_a_private_dir_of_ours(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectoryError, match=f"{link} \\(symlink owned by uid .*a symlink"):
        private_dir(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")  # planted for us to mkdir through: refused, nothing created
    with pytest.raises(UnsafeDirectoryError, match="a symlink"):
        private_dir(dangling)
    assert not (tmp_path / "nowhere").exists()


def test_a_file_in_place_of_the_runtime_dir_or_of_a_parent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("")
    with pytest.raises(UnsafeDirectoryError, match="not a directory"):
        private_dir(tmp_path / "run")


def test_a_runtime_dir_below_a_directory_others_may_write_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could rename our directory away and put theirs in its place
    with pytest.raises(UnsafeDirectoryError, match=f"{shared} .*mode 0o777.*others may write"):
        private_dir(shared / "run")
    assert not (shared / "run").exists()
    os.chmod(shared, 0o1777)  # sticky, like /tmp and /dev/shm: only the owner of an entry may move it
    assert private_dir(shared / "run") == shared / "run"
    assert _mode(shared / "run") == 0o700


@as_root
def test_a_runtime_dir_below_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)  # e.g. /dev/shm/etrain-<uid> pre-created by someone else
    with pytest.raises(UnsafeDirectoryError, match=f"{theirs} .*owned by uid {NOBODY}.*another user"):
        private_dir(theirs / "job" / "slots")
    assert not (theirs / "job").exists()


def test_symlinks_above_the_runtime_dir_are_resolved_and_where_they_lead_is_checked(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "alias").symlink_to(real)  # as /dev/shm -> /run/shm on some systems
    assert private_dir(tmp_path / "alias" / "run") == tmp_path / "alias" / "run"
    assert _mode(real / "run") == 0o700
    os.chmod(real, 0o777)
    with pytest.raises(UnsafeDirectoryError, match=f"{real} .*others may write"):
        private_dir(tmp_path / "alias" / "run")


def test_checking_only_never_creates_a_missing_runtime_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        private_dir(tmp_path / "a" / "run", create=False)
    assert not (tmp_path / "a").exists()
