"""Who a job's node-local tier belongs to, and clearing what owners that are gone left in ``/dev/shm``.

Each job's node-local snapshots live in a directory of their own under the node's root (``/dev/shm/etrain-<uid>/
<key>``, :func:`elastic.checkpoint.tiers.local_tier_dir`; a sharded model's in its ``shards/``). A worker that is
SIGKILLed, or a node lost whole, cannot delete them, and nothing else did: they stayed in memory for good. Here:

- **Owners.** Whoever writes snapshots there (:class:`~elastic.checkpoint.tiers.SnapshotTiers`' writer, each rank
  of :class:`~elastic.train.shard_tier.ShardTier`) first claims the job's directory (:func:`claim_job_dir`): it
  holds a shared ``flock`` on ``<dir>/.owners`` for its lifetime, and appends to that file ``pid start-time`` of
  the processes whose lifetime bounds the snapshots' use on this node (:func:`owner_processes`): its launcher
  (the torchrun agent, which restarts its workers, and they resume from what their predecessors wrote; the
  process itself outside torchrun), and the job service's node agent where the worker names it
  (``ETRAIN_PREFORK_OWNER``, which outlives the job's torchruns on this node).
- **Clearing.** :func:`sweep` deletes a job's directory when nobody holds it (an exclusive ``flock`` on its
  ``.owners`` is granted and no slot's lock is held) and none of the processes recorded there still runs (pid and
  start time, so a reused pid is not taken for its owner). A live owner's directory is never touched. The first
  worker of each node runs it as it starts (``create_snapshot_tiers``, ``create_shard_tier``), leaving out its own
  job's directory: that one it resumes from, and its restore drops the slots nobody holds.
- **Races.** The sweeper holds the exclusive lock while it renames the directory away (``.trash-*``, then deleted);
  a claimer takes the shared lock and then checks that ``<dir>/.owners`` is still the file it locked, and starts
  over if the directory was renamed meanwhile, so no claimer is left holding a directory being deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path

from elastic.checkpoint.slots import SlotClaim
from elastic.contract.env import PREFORK_OWNER, TorchrunEnv, WorkerEnvError
from elastic.prefork.common import launcher_pid
from elastic.proctree import alive, process_stat
from elastic.runtime_dir import private_dir

logger = logging.getLogger(__name__)

__all__ = ["OWNERS", "JobDirClaim", "claim_job_dir", "owner_processes", "sweep"]

OWNERS = ".owners"
_TRASH = ".trash-"
_ATTEMPTS = 5


def owner_processes() -> list[tuple[int, int]]:
    """``(pid, start time)`` of the processes whose lifetime bounds this worker's node-local snapshots (see the
    module docstring): its launcher, or itself outside torchrun, and the job service's node agent if named."""
    try:
        launched = TorchrunEnv.launched()
    except WorkerEnvError:
        launched = True
    pids = [launcher_pid() if launched else os.getpid()]
    agent = os.environ.get(PREFORK_OWNER, "")
    if agent.isascii() and agent.isdigit():
        pids.append(int(agent))
    found = []
    for pid in dict.fromkeys(pids):
        st = process_stat(pid)
        if st is not None:
            found.append((pid, st[1]))
    return found


def _records(fd: int) -> list[tuple[int, int]]:
    raw = os.pread(fd, 1 << 16, 0).decode(errors="replace")
    out = []
    for line in raw.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            out.append((int(parts[0]), int(parts[1])))
    return out


class JobDirClaim(SlotClaim):
    """This process's claim on a job's node-local directory: ``path`` (until :meth:`release` or its end); its lock
    file's descriptor holds a shared lock, which closing drops, as a slot's exclusive one."""


def claim_job_dir(job_dir: Path) -> JobDirClaim:
    """Make ``job_dir`` (a private directory, :func:`~elastic.runtime_dir.private_dir`) and claim it (see the module
    docstring). Raises ``OSError`` (:class:`~elastic.runtime_dir.UnsafeDirectoryError` for a directory another user
    could reach into)."""
    owners = owner_processes()
    records = "".join(f"{pid} {start}\n" for pid, start in owners).encode()
    for _ in range(_ATTEMPTS):
        try:
            private_dir(job_dir)
            fd = os.open(job_dir / OWNERS, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # renamed away by a sweeper between the two: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a sweeper holds its exclusive lock for milliseconds
            if os.stat(job_dir / OWNERS, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(job_dir / OWNERS)
            if not set(_records(fd)) >= set(owners):
                os.write(fd, records)
        except FileNotFoundError:  # swept while we waited for the lock: start over
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return JobDirClaim(job_dir, fd)
    raise OSError(f"could not claim {job_dir}: removed {_ATTEMPTS} times while being claimed")


def _slot_held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _sweep_one(job_dir: Path, root: Path) -> bool:
    """Delete ``job_dir`` if nobody holds it and its owners are gone; whether it was deleted."""
    try:
        fd = os.open(job_dir / OWNERS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a writer of this job runs
        if os.stat(job_dir / OWNERS, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return False
        if any(alive(pid, start) for pid, start in _records(fd)):
            return False
        if any(_slot_held(lock) for lock in (*job_dir.glob("*.lock"), *job_dir.glob("*/*.lock"))):
            return False  # a writer that claimed no job directory (an older version of this library)
        trash = root / f"{_TRASH}{uuid.uuid4().hex[:12]}"
        os.rename(job_dir, trash)
    except OSError:
        return False
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def sweep(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete the job directories under ``root`` that owners that are gone left behind (see the module docstring),
    except ``keep``. Returns the directories deleted. Never raises for the file system: a root that is missing or
    not private is left alone."""
    try:
        private_dir(root, create=False)
        entries = list(root.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        if entry.name.startswith(_TRASH):  # a sweeper that died deleting it
            shutil.rmtree(entry, ignore_errors=True)
            continue
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        if keep is not None and os.path.abspath(entry) == os.path.abspath(keep):
            continue
        if _sweep_one(entry, root):
            removed.append(entry)
    if removed:
        logger.info(
            "node-local snapshots: deleted %d left behind under %s by processes that are gone (%s)",
            len(removed),
            root,
            ", ".join(p.name for p in removed),
        )
    return removed
