"""Slots: directories on node-local storage that one live process at a time writes, claimed with ``flock``.

Used by both node-local snapshot tiers (:mod:`elastic.checkpoint.tiers`, prefix ``slot-``, and
:mod:`elastic.train.shard_tier`, prefix ``n<shard_size>-i<shard_index>-``). Contract:

- A slot is the directory ``<root>/<prefix><k>`` (``k`` = 0, 1, ... below ``max_slots``) with its lock file
  ``<root>/<prefix><k>.lock`` beside it (created 0600). Its holder is the process holding an exclusive ``flock`` on
  that lock file. The kernel drops the lock when the holder closes it or dies, so the slot of a dead writer is free
  again, and whoever claims it next finds what that writer left there.
- :func:`claim_slot` takes the first slot nobody holds (its lock file is opened ``O_NOFOLLOW``) and keeps it until
  :meth:`SlotClaim.release`, or None when all ``max_slots`` are held. It neither creates nor checks ``root`` (the
  callers make it with :func:`elastic.runtime_dir.private_dir` first) nor the slot's directory (its writer does).
- :func:`slot_dirs` lists the slot directories that exist under ``root`` for ``prefix`` (held or not), by name.
- :func:`is_held` tells whether a live process holds a slot now: it takes the lock and drops it at once.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["MAX_SLOTS", "SlotClaim", "claim_slot", "is_held", "slot_dirs"]

MAX_SLOTS = 64


class SlotClaim:
    """A slot this process holds: ``path`` (its directory) until :meth:`release` (or this process ends)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing the lock file drops it); a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock_nb(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; False: another open file description holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def claim_slot(root: Path, prefix: str, max_slots: int = MAX_SLOTS) -> SlotClaim | None:
    """The first slot ``<root>/<prefix><k>`` nobody holds, now held by this process; None: all are held."""
    for k in range(max_slots):
        slot = root / f"{prefix}{k}"
        fd = os.open(f"{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        if _lock_nb(fd):
            return SlotClaim(slot, fd)
        os.close(fd)
    return None


def slot_dirs(root: Path, prefix: str) -> list[Path]:
    """The slot directories under ``root`` whose names start with ``prefix``, sorted by name."""
    return sorted(p for p in root.glob(f"{prefix}*") if p.is_dir())


def is_held(slot: Path) -> bool:
    """Whether a live process holds ``slot`` (a probe: the lock is taken and dropped at once)."""
    fd = os.open(f"{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        return not _lock_nb(fd)
    finally:
        os.close(fd)  # closing drops a lock we just took
