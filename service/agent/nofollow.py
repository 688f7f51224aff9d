"""What the agent does to files in directories a job can write: its private directory (the job's ``HOME``),
``/tmp``, ``/var/tmp``, ``/dev/shm``. Nothing here follows a symlink a job placed, or acts on what one leads to.

The agent runs as root, with no capability but SETUID, SETGID, CHOWN and KILL in the chart (no DAC override,
no FOWNER): to delete a job's directory it first *takes* it (chown to itself, then 0700, since a job may leave
one 0000), then lists and empties it. Each directory is opened ``O_PATH | O_NOFOLLOW | O_DIRECTORY`` relative to
its parent's descriptor, checked with ``fstat`` (a directory; of the expected owner where one is expected), and
changed and reopened through that descriptor (``/proc/self/fd/N``): a symlink, or anything a job swaps in
meanwhile, is never what gets changed or entered. Files, symlinks, fifos and sockets are unlinked, never opened,
chowned or chmodded (a hard link to another user's file stays as it is). Depth costs neither recursion nor
descriptors: the subdirectories of each directory being emptied are moved up into the top one of the tree first,
so a tree of any depth is deleted with three descriptors open. Linux only (``O_PATH``, ``/proc/self/fd``), as
the agent is.

Secrets are written ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the descriptor of a directory checked to be
this process's and private: a name someone placed first (a symlink, a hard link) fails the write, which never
goes through it.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["ForeignOwner", "remove_entry", "remove_files_of", "remove_tree", "write_new_secret"]

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: what ``rename`` says when the name it moves a directory to is taken (then another name is tried)
_NAME_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


class ForeignOwner(PermissionError):
    """An entry that is not the expected uid's (it changed hands between a listing and its removal): left alone."""


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _take_dir(parent_fd: int, name: str, owner: int | None = None) -> int:
    """A descriptor for listing directory ``name`` of ``parent_fd``, which is made this process's and 0700 first;
    never through a symlink (:class:`NotADirectoryError`). ``owner``: refuse one not owned by that uid."""
    pfd = os.open(name, _PATH_FLAGS, dir_fd=parent_fd)  # a symlink: ENOTDIR, not followed
    try:
        st = os.fstat(pfd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", name)
        if owner is not None and st.st_uid != owner:
            raise ForeignOwner(errno.EPERM, f"owned by uid {st.st_uid}, not {owner}", name)
        this = f"/proc/self/fd/{pfd}"  # the directory just checked, whatever the name leads to by now
        me, my_group = os.geteuid(), os.getegid()
        if (st.st_uid, st.st_gid) != (me, my_group):
            os.chown(this, me, my_group)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(this, 0o700)
        return os.open(this, _DIR_FLAGS)
    finally:
        os.close(pfd)


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _lift(from_fd: int, name: str, top_fd: int) -> None:
    """Move directory ``name`` of ``from_fd`` into ``top_fd`` under a fresh name (moving a directory to another
    parent needs write permission on it: it is taken first)."""
    os.close(_take_dir(from_fd, name))
    while True:
        try:
            os.rename(name, f".etrain-removing-{secrets.token_hex(8)}", src_dir_fd=from_fd, dst_dir_fd=top_fd)
            return
        except OSError as exc:
            if exc.errno not in _NAME_TAKEN:
                raise


def _empty(top_fd: int) -> None:
    """Delete everything in the (taken) directory ``top_fd``, one level at a time: each directory found there is
    taken, its files unlinked and its subdirectories moved up into ``top_fd``, then it is removed; until
    ``top_fd`` is empty."""
    while names := os.listdir(top_fd):
        for name in names:
            st = _lstat(top_fd, name)
            if st is None:
                continue
            if not stat.S_ISDIR(st.st_mode):
                _unlink(top_fd, name)
                continue
            sub = _take_dir(top_fd, name)
            try:
                for inner in os.listdir(sub):
                    inner_st = _lstat(sub, inner)
                    if inner_st is not None and stat.S_ISDIR(inner_st.st_mode):
                        _lift(sub, inner, top_fd)
                    elif inner_st is not None:
                        _unlink(sub, inner)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=top_fd)


def remove_tree(parent_fd: int, name: str, owner: int | None = None) -> None:
    """Delete directory ``name`` of ``parent_fd`` with everything below it, following no symlink (one at
    ``name``: :class:`NotADirectoryError`). ``owner``: only if that uid owns it (else :class:`ForeignOwner`)."""
    top = _take_dir(parent_fd, name, owner)
    try:
        _empty(top)
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=parent_fd)


def remove_entry(parent_fd: int, name: str) -> None:
    """Delete ``name`` of ``parent_fd``, whatever it is (a directory with everything below it); gone: nothing."""
    st = _lstat(parent_fd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(parent_fd, name)
    else:
        _unlink(parent_fd, name)


def remove_files_of(uid: int, dirs: Iterable[Path]) -> int:
    """Delete what ``uid`` owns directly in each of ``dirs`` (a directory of its with everything in it: what that
    uid could have deleted itself), never an entry owned by another uid, following no symlink; returns how many
    entries went. A directory of ``dirs`` that does not exist is skipped; what cannot be deleted is logged."""
    removed = 0
    for d in dirs:
        try:
            dir_fd = os.open(d, _DIR_FLAGS)  # the configured directory itself may be a link (/dev/shm -> /run/shm)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot look for the files of uid %d in %s: %s", uid, d, exc)
            continue
        try:
            for name in os.listdir(dir_fd):
                st = _lstat(dir_fd, name)
                if st is None or st.st_uid != uid:
                    continue
                try:
                    if stat.S_ISDIR(st.st_mode):
                        remove_tree(dir_fd, name, owner=uid)
                    else:
                        os.unlink(name, dir_fd=dir_fd)
                    removed += 1
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    logger.warning("cannot delete %s of uid %d: %s", os.path.join(d, name), uid, exc)
        finally:
            os.close(dir_fd)
    return removed


def write_new_secret(directory: Path, name: str, secret: str) -> Path:
    """Write ``secret`` (and a newline) to a new file ``name`` (0600) in ``directory``, which must be this
    process's and private (no group or other permission) and not a symlink; a ``name`` that exists already,
    a symlink or a hard link included, is refused (:class:`FileExistsError`), never written through."""
    dir_fd = os.open(directory, _DIR_FLAGS | os.O_NOFOLLOW)
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(
                errno.EPERM,
                f"not a private directory of uid {os.geteuid()} (owner "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
                str(directory),
            )
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            data = memoryview(secret.encode() + b"\n")
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return directory / name
