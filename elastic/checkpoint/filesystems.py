"""What the host knows about a local checkpoint root: its file system type, and its page cache.

Used by :class:`~elastic.checkpoint.storage.LocalStorage` to decide what verifying a new snapshot proves
(see :mod:`elastic.checkpoint.verification`) and to read a file back from the medium rather than the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["drop_cached_pages", "filesystem_type", "is_network_filesystem"]

# File systems whose bytes live on other machines: a read-back from the servers proves the write arrived.
_NETWORK_FILESYSTEMS = frozenset(
    {"lustre", "nfs", "nfs4", "ceph", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "glusterfs", "9p", "afs", "orangefs"}
)


def is_network_filesystem(fs_type: str) -> bool:
    """Whether a file system of this type keeps its bytes on other machines (FUSE mounts count: s3fs, gcsfuse,
    sshfs and the like)."""
    return fs_type in _NETWORK_FILESYSTEMS or fs_type.startswith("fuse")


def drop_cached_pages(fd: int) -> bool:
    """Ask the kernel to drop the clean cached pages of open file ``fd`` (``posix_fadvise(DONTNEED)``), so the
    next read comes from the disk or the file servers; whether the call exists here (not on macOS).

    Only clean pages go: callers fsync first (every file :meth:`LocalStorage.open_write` wrote is).  Chosen
    over ``O_DIRECT``, which needs block-aligned buffers, offsets and lengths (a file's tail is not) and is
    refused by tmpfs and several FUSE and network file systems; this works wherever Linux caches pages."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return False
    fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def filesystem_type(path: str | Path) -> str | None:
    """The Linux file system type (``ext4``, ``lustre``, ``nfs4``, ...) of the mount holding ``path``, from
    ``/proc/self/mountinfo``; ``None`` where that cannot be told (not Linux, unreadable)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= best[0]):  # the last of equal mount points is on top
            best = (len(mount), right.split()[0])
    return None if best is None else best[1]
