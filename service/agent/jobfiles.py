"""A node agent's side of job isolation: each job's private directory, secrets and uid (the rules and the system
calls are :mod:`service.agent.isolation`; this is the agent's state: which job holds which uid and directory).

Per job, ``<work dir>/jobs/<job>/private`` (0700) holds its secrets, 0600 each: ``etcd-password`` (its own etcd
user's), ``checkpoint-key`` (its manifest-signing key, ``ETRAIN_CHECKPOINT_KEY_FILE``: never in the environment)
and, when it runs as a uid of its own, copies of the etcd TLS files (``etcd-ca.pem``, ``etcd-cert.pem``,
``etcd-key.pem``; the agent's own stay unreadable to jobs). The directory is deleted, and the uid released, when
the job leaves the node: every process of that uid is killed, then what the uid owns at the top of the node's
temporary directories (``AgentSettings.job_tmp_dirs``: ``/tmp``, ``/var/tmp``, ``/dev/shm``) is deleted, so that
the next job given the uid does not inherit it; a uid another job released lately is handed out last
(:func:`service.agent.isolation.allocate_uid`). Nothing the job left is followed or written through when the
agent deletes it or writes the job's secrets (:mod:`service.agent.nofollow`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from elastic.etcd.config import EtcdOptions
from service.agent.hidepid import MOUNTINFO, check_proc
from service.agent.isolation import (
    JobUser,
    allocate_uids,
    can_switch_uid,
    effective_caps,
    hand_over,
    kill_processes_of,
    make_private_dir,
    not_searchable,
    recent_releases,
    remove_private_dir,
    secret_exposure,
)
from service.agent.launcher import job_etcd
from service.agent.nofollow import remove_files_of, write_new_secret
from service.core.config import AgentSettings
from service.core.models import Assignment, Isolation

logger = logging.getLogger(__name__)

__all__ = ["IsolationError", "JobFiles", "PreparedJob"]


class IsolationError(RuntimeError):
    """The agent cannot keep jobs apart as configured (one line)."""


@dataclass(frozen=True)
class PreparedJob:
    """What a job gets on this node before its torchrun starts (:meth:`JobFiles.prepare`)."""

    etcd: EtcdOptions
    key_file: Path | None
    home: Path | None  # set when the job runs as a uid of its own
    user: JobUser | None


class JobFiles:
    """Each job's private directory, secrets and uid on one node; checks at creation how jobs are kept apart."""

    def __init__(self, settings: AgentSettings, *, mountinfo: Path = MOUNTINFO) -> None:
        self.settings = settings
        self._secrets: set[str] = set()  # jobs whose private directory this agent made
        self._uids: dict[str, int] = {}  # job -> the uid its torchrun runs as (with a uid range)
        self._released: dict[int, str] = {}  # uid -> the job that released it, the latest release last
        self._mountinfo = mountinfo
        # with a uid range: whether /proc hides a job's command line (its args) from the other jobs (None: unknown)
        self.args_hidden: bool | None = None
        self.isolation = self._check()

    def uid_of(self, job_id: str) -> int | None:
        return self._uids.get(job_id)

    def _check(self) -> Isolation:
        """How this node keeps its jobs apart (``service.agent.isolation``); an :class:`IsolationError` when the uid
        range cannot work or a secret of the agent's would be readable by jobs."""
        s = self.settings
        secrets_ = [f for f in (s.etcd.password_file, s.etcd.cert_key) if f]
        if s.job_uid_range is not None:
            if not can_switch_uid():
                raise IsolationError(
                    f"--job-uid-range {s.job_uid_range} needs root or the capabilities SETUID, SETGID, CHOWN and KILL; "
                    "without them start the agent with --job-owner NAME instead (one owner's jobs, as the agent's uid)"
                )
            for path in secrets_:
                problem = secret_exposure(path, s.job_uid_range)
                if problem:
                    raise IsolationError(f"{problem}: jobs on this node could read it")
            self._reachable_work_dir()
            unreachable = not_searchable(Path(s.python).resolve())
            if unreachable:
                logger.warning(
                    "the jobs' uids cannot run %s: %s; give the agent --python an interpreter they can run",
                    s.python,
                    unreachable,
                )
            proc = check_proc([os.getegid(), *os.getgroups()], effective_caps(), self._mountinfo)
            self.args_hidden = proc.args_hidden
            if proc.warning:
                logger.warning("%s", proc.warning)
            logger.info("jobs run as uids of their own from %s (no supplementary groups)", s.job_uid_range)
            return Isolation.UID
        for path in secrets_:
            problem = secret_exposure(path, None)
            if problem:
                logger.warning("%s: every job on this node can read it", problem)
        me = os.geteuid()
        if s.job_owner:
            logger.warning(
                "jobs run as this agent's uid %d: only jobs of %s are placed here (--job-owner)", me, s.job_owner
            )
            return Isolation.OWNER
        logger.warning(
            "jobs of every owner run as this agent's uid %d: a job can read the others' secrets and this agent's "
            "files; start the agent with --job-uid-range (root or CAP_SETUID/SETGID/CHOWN/KILL) or --job-owner NAME",
            me,
        )
        return Isolation.NONE

    def _reachable_work_dir(self) -> None:
        """``<work dir>/jobs`` made 0711 (the jobs' uids reach their own directories below it, but list nothing);
        an :class:`IsolationError` when a directory above it is not searchable by them."""
        jobs = (self.settings.work_dir / "jobs").resolve()
        jobs.mkdir(parents=True, exist_ok=True)
        os.chmod(jobs, 0o711)
        unreachable = not_searchable(jobs)
        if unreachable:
            raise IsolationError(
                f"the jobs' uids cannot reach their private directories under {jobs}: {unreachable} "
                "(add o+x, or choose another --work-dir)"
            )

    def _private_dir(self, job_id: str) -> Path:
        # resolved above the job's directory only: nothing below it is followed
        return (self.settings.work_dir / "jobs").resolve() / job_id / "private"

    def _job_user(self, job_id: str) -> JobUser | None:
        uids = self.settings.job_uid_range
        if uids is None:
            return None
        fresh = job_id not in self._uids
        recent = [u for u, holder in self._released.items() if holder != job_id]  # its own: no one else's files
        self._uids = allocate_uids(self._uids, [*self._uids, job_id], uids, recent)
        uid = self._uids[job_id]
        if fresh:
            self._released.pop(uid, None)
            if kill_processes_of(uid):  # left by an earlier agent's job (its pdeath signal ignored)
                logger.warning(
                    "uid %d: killed the processes an earlier job left before giving it to job %s", uid, job_id
                )
            if n := remove_files_of(uid, self.settings.job_tmp_dirs):  # an earlier agent's job's, never cleaned
                logger.warning(
                    "uid %d: deleted %d file(s) an earlier job left in %s before giving it to job %s",
                    uid,
                    n,
                    ", ".join(map(str, self.settings.job_tmp_dirs)),
                    job_id,
                )
        return JobUser(uid, uid)

    def _release(self, job_id: str, uid: int) -> None:
        """Job ``job_id`` has left the node: kill what runs as its uid, delete what that uid owns at the top of the
        temporary directories, and hand the uid to later jobs last."""
        if n := kill_processes_of(uid):  # escaped the torchrun's tree: not past the job
            logger.warning("job %s: killed %d process(es) of its uid %d left after it", job_id, n, uid)
        if n := remove_files_of(uid, self.settings.job_tmp_dirs):
            logger.info(
                "job %s: deleted %d file(s) of its uid %d in %s",
                job_id,
                n,
                uid,
                ", ".join(map(str, self.settings.job_tmp_dirs)),
            )
        self._released.pop(uid, None)
        self._released[uid] = job_id
        uids = self.settings.job_uid_range
        while len(self._released) > recent_releases(uids.size if uids else 1):
            del self._released[next(iter(self._released))]

    def unreachable_cwd(self, cwd: Path) -> str | None:
        """Why a job that runs as a uid of its own cannot work in ``cwd`` (None: it can, or it runs as the agent)."""
        if self.settings.job_uid_range is None:
            return None
        return not_searchable(cwd, itself=True)

    def prepare(self, a: Assignment) -> PreparedJob:
        """The job's private directory (0700) and its secrets in it (0600), handed to its uid: its etcd password,
        its manifest-signing key and, when it runs as a uid of its own, copies of the etcd TLS files; then its
        etcd connection (:func:`job_etcd`)."""
        user = self._job_user(a.job_id)
        private = self._private_dir(a.job_id)
        self._secrets.add(a.job_id)
        make_private_dir(private)  # its parent made 0711: the agent's logs below, the private directory reachable
        password_file: Path | None = None
        key_file: Path | None = None
        if a.etcd_user and a.etcd_password:
            password_file = write_new_secret(private, "etcd-password", a.etcd_password)
        if a.checkpoint_key:
            key_file = write_new_secret(private, "checkpoint-key", a.checkpoint_key)
        etcd = job_etcd(self.settings.etcd, a, password_file)
        if user is not None:  # the agent's TLS files stay its own (0400/0600): the job gets copies of its uid

            def copy(path: str | None, name: str) -> str | None:
                if not path:
                    return None
                return str(write_new_secret(private, name, Path(path).read_text().rstrip("\n")))

            etcd = replace(
                etcd,
                ca_cert=copy(etcd.ca_cert, "etcd-ca.pem"),
                cert=copy(etcd.cert, "etcd-cert.pem"),
                cert_key=copy(etcd.cert_key, "etcd-key.pem"),
            )
            hand_over(private, user)
        return PreparedJob(etcd, key_file, private if user is not None else None, user)

    def forget(self, assigned: Iterable[str]) -> None:
        """Delete the private directories of jobs no longer assigned to this node, and release their uids."""
        for job_id in self._secrets - set(assigned):
            self._secrets.discard(job_id)
            uid = self._uids.pop(job_id, None)
            if uid is not None:
                self._release(job_id, uid)
            try:
                remove_private_dir(self._private_dir(job_id))
            except OSError as exc:
                logger.warning("cannot delete the private directory of job %s: %s", job_id, exc)
