"""Private per-user runtime directories under shared places such as ``/tmp`` and ``/dev/shm``.

The prefork zygote's socket (``/tmp/etrain-prefork-<uid>``: clients send it their environment, secrets
included) and the node-local snapshots (``/dev/shm/etrain-<uid>``: a resume trusts what it finds there) live
at predictable paths in world-writable directories. Another local user could create such a path first and
own what we put there. :func:`private_dir` makes or accepts one only if nobody else can reach into it:

- the directory itself: created with mode 0700; an existing one must be a real directory (not a symlink),
  owned by this process's effective uid, with no group or other permission bits;
- every directory above it: owned by root or by us, and not writable by group or others unless it has the
  sticky bit (as ``/tmp`` and ``/dev/shm`` do), so that nobody else can rename or replace what is below it.
  Symlinks above it are resolved first (e.g. ``/dev/shm -> /run/shm``): the directories they lead to are the
  ones checked.

Missing components are created one at a time, each opened with ``O_NOFOLLOW`` relative to its checked parent
and checked with ``fstat`` on that descriptor, so a symlink or directory planted between our ``mkdir`` and our
check is what gets checked (and refused), never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = ["UnsafeDirectoryError", "private_dir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UnsafeDirectoryError(PermissionError):
    """A runtime directory (or one above it) that another user could control: refused, never used."""

    def __init__(self, path: Path | str, st: os.stat_result | None, why: str) -> None:
        if st is None:
            detail = ""
        else:
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "file"
            detail = f" ({kind} owned by uid {st.st_uid}, mode 0o{stat.S_IMODE(st.st_mode):03o})"
        super().__init__(
            f"refusing runtime directory {path}{detail}: {why}; it must be a directory owned by uid "
            f"{os.geteuid()} with mode 0700 (remove it, or set it right, and try again)"
        )
        self.path = Path(path)


def _check_leaf(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(path, st, "not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(path, st, "owned by another user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeDirectoryError(path, st, "group or others may read, write or enter it")


def _check_ancestor(path: Path, st: os.stat_result, leaf: Path) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(path, st, f"a component of {leaf} that is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectoryError(path, st, f"a directory above {leaf} owned by another user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectoryError(path, st, f"a directory above {leaf} that others may write (and no sticky bit)")


def _open_child(parent_fd: int, parent: Path, name: str) -> tuple[int, os.stat_result]:
    """``name`` in ``parent`` opened as a directory without following a symlink, with its ``fstat``."""
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.lstat(name, dir_fd=parent_fd)
        why = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafeDirectoryError(parent / name, st, why) from None
    return fd, os.fstat(fd)


def private_dir(path: Path | str, create: bool = True) -> Path:
    """``path`` as a private directory of this user (see the module docstring), created with its missing
    parents (each 0700) if ``create``. Returns ``path``. Raises :class:`UnsafeDirectoryError` (a
    :class:`PermissionError`) naming the path, its owner and mode if it or a directory above it is unsafe,
    ``FileNotFoundError`` if it is missing and not ``create``, and any other ``OSError`` of ``mkdir``."""
    path = Path(path)
    absolute = Path(os.path.abspath(path))
    if absolute == Path(absolute.anchor):
        raise UnsafeDirectoryError(absolute, os.lstat(absolute), "the root directory")
    existing, missing = absolute.parent, [absolute.name]
    while not os.path.lexists(existing):
        missing.insert(0, existing.name)
        existing = existing.parent
    existing = Path(os.path.realpath(existing))  # symlinks above the leaf: where they lead is what is checked
    # every directory from / down to the deepest one that exists, top-down, so none can be swapped under us
    for depth in range(1, len(existing.parts) + 1):
        component = Path(*existing.parts[:depth])
        _check_ancestor(component, os.lstat(component), absolute)
    fd = os.open(existing, _DIR_FLAGS)
    where = existing
    try:
        for i, name in enumerate(missing):
            leaf = i == len(missing) - 1
            created = False
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass
            child, st = _open_child(fd, where, name)
            os.close(fd)
            fd, where = child, where / name
            if created and stat.S_IMODE(st.st_mode) != 0o700:  # the umask took bits off; ours, fresh: set them
                os.fchmod(fd, 0o700)
                st = os.fstat(fd)
            if leaf:
                _check_leaf(absolute, st)
            else:
                _check_ancestor(where, st, absolute)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return path
