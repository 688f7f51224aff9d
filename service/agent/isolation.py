"""Per-job OS identities on a node: which uid each job's torchrun runs as, and where its secrets lie.

An agent started with a uid range (``--job-uid-range 20000-29999``) runs each job's torchrun (and so its workers)
as a uid and gid of its own from that range, with no supplementary groups. A job's private directory
``<work dir>/jobs/<job>/private`` (0700, owned by that uid) holds its secrets, each a 0600 file of that uid: its
etcd password, its manifest-signing key, copies of the etcd client TLS files it needs. Another job's uid cannot
read them, nor its ``/proc/<pid>/environ``, nor anything of the agent's that is not world-readable.

Needs root or the capabilities SETUID, SETGID, CHOWN and KILL (to stop the jobs' processes). An agent without them
cannot switch uid: it then runs every job as its own uid, and with ``--job-owner NAME`` only that owner's jobs
(placement sends it no other's, see :class:`service.core.models.NodeInfo`); without either it runs anyone's jobs
as itself, which it says at start: jobs on such a node can read each other's secrets.

The uid of a job is :func:`allocate_uid`, a pure function of the job id, the uids of the jobs running on the
node and the uids other jobs released lately (handed out last): deterministic, collision-free among the running
jobs, released when the job leaves the node (its processes killed, what it owns in ``/tmp``, ``/var/tmp`` and
``/dev/shm`` deleted: :mod:`service.agent.jobfiles`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.agent.nofollow import remove_entry
from service.core.config import UidRange
from service.core.models import Isolation

logger = logging.getLogger(__name__)

__all__ = [
    "Isolation",
    "JobUser",
    "UidRange",
    "UidRangeExhausted",
    "allocate_uid",
    "allocate_uids",
    "can_switch_uid",
    "effective_caps",
    "hand_over",
    "kill_processes_of",
    "make_private_dir",
    "not_searchable",
    "recent_releases",
    "remove_private_dir",
    "secret_exposure",
]

_CAP_CHOWN, _CAP_KILL, _CAP_SETGID, _CAP_SETUID = 0, 5, 6, 7
#: the most releases :func:`allocate_uid` avoids handing out again (see :func:`recent_releases`)
RECENT_RELEASES = 64


class UidRangeExhausted(RuntimeError):
    """Every uid of the range is held by a job running on this node."""


@dataclass(frozen=True)
class JobUser:
    """The OS identity a job's torchrun runs as."""

    uid: int
    gid: int


def allocate_uid(job_id: str, taken: Collection[int], uids: UidRange, recent: Sequence[int] = ()) -> int:
    """The uid of a job that starts on a node whose running jobs hold ``taken`` (pure): the first free uid from a
    hash of the job id on, so a job usually gets the same uid on every node and after an agent restart; skipping
    ``recent``, the uids other jobs released lately (least recently released first), unless no other is free:
    then the one released longest ago.

    Why a hash rather than least-recently-released order alone: a job's files on shared storage (its checkpoint
    prefix) are then one uid's on every node, so the job can replace on one node what it wrote on another. Why
    ``recent`` as well: a uid just released is not the next job's, so what its holder left in a place the agent
    does not clean (see :func:`service.agent.nofollow.remove_files_of`) is not the next job's at once. The caller
    keeps ``recent`` short (:data:`RECENT_RELEASES`), so that it seldom holds the uid a job's hash prefers."""
    avoid = set(recent)
    start = int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "big") % uids.size
    for i in range(uids.size):
        uid = uids.low + (start + i) % uids.size
        if uid not in taken and uid not in avoid:
            return uid
    for uid in recent:
        if uid not in taken and uid in uids:
            return uid
    raise UidRangeExhausted(f"every uid of {uids} is held by a job running on this node")


def allocate_uids(
    running: Mapping[str, int], jobs: Iterable[str], uids: UidRange, recent: Sequence[int] = ()
) -> dict[str, int]:
    """The uid of each of ``jobs`` (pure): a job in ``running`` (job -> uid) keeps its uid, the others get one
    by :func:`allocate_uid` (``recent`` as there) in job-id order; uids of jobs not in ``jobs`` are released."""
    wanted = sorted(set(jobs))
    out = {j: running[j] for j in wanted if j in running}
    for job_id in wanted:
        if job_id not in out:
            out[job_id] = allocate_uid(job_id, set(out.values()), uids, recent)
    return out


def recent_releases(size: int) -> int:
    """How many of the latest releases :func:`allocate_uid` avoids in a range of ``size`` uids: a short window
    (at most 64, and half the range), so that a job's preferred uid is seldom among them."""
    return max(1, min(RECENT_RELEASES, size // 2))


def effective_caps() -> int:
    """This process's effective capabilities (a bit mask; 0 when unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def can_switch_uid() -> bool:
    """Whether this process may run children as other uids, hand them files and signal them: the capabilities
    SETUID, SETGID, CHOWN and KILL (root has them unless they were dropped)."""
    caps = effective_caps()
    needed = (1 << _CAP_SETUID) | (1 << _CAP_SETGID) | (1 << _CAP_CHOWN) | (1 << _CAP_KILL)
    return caps & needed == needed


def kill_processes_of(uid: int) -> int:
    """SIGKILL every process whose real or effective uid is ``uid`` (a job's processes that escaped its torchrun's
    tree, e.g. by daemonizing, must not outlive the job: the uid goes to another job next); returns how many."""
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            line = next(x for x in (entry / "status").read_text().splitlines() if x.startswith("Uid:"))
            real, effective = (int(v) for v in line.split()[1:3])
            if uid in (real, effective):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile, or not ours to read
    return killed


def not_searchable(path: Path, itself: bool = False) -> str | None:
    """Which directory above ``path`` (``itself``: or ``path``, a directory) other users cannot pass through (None:
    they reach it)."""
    real = path.resolve()
    for d in (real, *real.parents) if itself else real.parents:
        mode = d.stat().st_mode
        if not mode & 0o001:
            return f"{d} is not searchable by other users (mode {mode & 0o7777:04o})"
    return None


def secret_exposure(path: str | Path, uids: UidRange | None) -> str | None:
    """Why a secret file of the agent's may be readable by jobs (None: it is not, as far as its mode and owner
    go): readable by others, owned by a job uid, or readable by a group whose gid is a job gid. With ``uids``
    None (jobs run as the agent's uid) only world-readable counts."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: cannot stat: {exc.strerror or exc}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o004:
        return f"{path} is readable by every user (mode {mode:04o}; make it 0400 or 0600)"
    if uids is not None and st.st_uid in uids:
        return f"{path} is owned by uid {st.st_uid}, one of the jobs' uids ({uids})"
    if uids is not None and mode & 0o040 and st.st_gid in uids:
        return f"{path} is readable by group {st.st_gid}, one of the jobs' gids ({uids})"
    return None


def make_private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 directory of this process, in place of anything an earlier job left there
    (removed following no symlink, :mod:`service.agent.nofollow`); its parent (created if missing) is made 0711.
    The agent writes the job's secrets in it (:func:`service.agent.nofollow.write_new_secret`), then
    :func:`hand_over` gives it to the job's uid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fchmod(parent, 0o711)  # the job's directory: the agent's logs below, its private one reachable
        remove_entry(parent, path.name)
        os.mkdir(path.name, 0o700, dir_fd=parent)
        fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.fchmod(fd, 0o700)  # whatever the umask
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def hand_over(path: Path, user: JobUser) -> None:
    """Give a private directory and the files in it to the job's uid and gid (modes kept: 0700, 0600); the
    directory last, so that the agent needs no DAC override to write it first."""
    for entry in path.iterdir():
        os.chown(entry, user.uid, user.gid, follow_symlinks=False)
    os.chown(path, user.uid, user.gid, follow_symlinks=False)


def remove_private_dir(path: Path) -> None:
    """Delete a job's private directory (the job's ``HOME``: whatever the job left there, symlinks included, is
    deleted without following any, :func:`service.agent.nofollow.remove_tree`); gone already: nothing."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        remove_entry(parent, path.name)
    finally:
        os.close(parent)
