"""How a node agent runs one job generation: the stock torchrun command, its environment, its process tree.

:func:`torchrun_command` and :func:`worker_env` are pure. :class:`TorchrunProcess` starts torchrun in a
session of its own with a parent-death signal (SIGTERM when the agent dies, so a dead agent never leaves
a node's workers running), and stops the whole tree: torchrun's workers run in sessions of their own, so
the tree is found through ``/proc`` before any signal is sent.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from elastic.compat import disable_shared_rdzv_store
from elastic.contract.env import JobEnv, WorkerEnv
from elastic.contract.rendezvous import RendezvousConf
from elastic.etcd.config import EtcdOptions
from elastic.prefork import worker_tree
from elastic.proctree import alive, descendants, exec_with_parent_death_signal, process_stat
from elastic.torchrun_cli import TorchrunCommand
from service.agent.isolation import JobUser
from service.core.models import Assignment

logger = logging.getLogger(__name__)

__all__ = [
    "JobIdentityError",
    "TorchrunProcess",
    "descendants",
    "job_etcd",
    "rdzv_conf",
    "torchrun_command",
    "worker_env",
    "write_secret",
]

#: ``--rdzv-conf`` keys the agent writes even at their default (the rest only when they differ from it)
_ALWAYS_RENDERED = ("key_prefix", "last_call_timeout", "join_timeout", "node_ttl", "connect_timeout")


class JobIdentityError(ValueError):
    """The agent cannot give a job an etcd identity that is not the control plane's."""


def job_etcd(control: EtcdOptions, assignment: Assignment, password_file: Path | None) -> EtcdOptions:
    """The etcd connection a job's torchrun and workers get: the agent's endpoints, TLS files and timeouts,
    with the job's own user (its password in ``password_file``) and never the agent's user or password.

    An assignment without a user of its own gets no user at all when the agent has none either (the control
    plane uses no etcd password: jobs share its identity, see docs/service.md); when the agent has one it
    is refused (:class:`JobIdentityError`) rather than handed over.
    """
    if assignment.etcd_user:
        if password_file is None:
            raise JobIdentityError(f"job {assignment.job_id}: no password file for its etcd user")
        return replace(control, user=assignment.etcd_user, password_file=str(password_file), password=None)
    if control.user:
        raise JobIdentityError(
            f"the assignment of job {assignment.job_id} carries no etcd user of its own, and this agent's etcd "
            "user is a control-plane one: refusing to hand it to the job (is the controller older than the "
            "agent, or its etcd user without the root role it needs to make job users?)"
        )
    return replace(control, password_file=None, password=None)


def write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path``, readable by this user only (0600), replacing any earlier file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by a crash keeps its mode: set it
        os.write(fd, secret.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)


def rdzv_conf(assignment: Assignment, etcd: EtcdOptions, rdzv_prefix: str) -> str:
    """The ``--rdzv-conf`` string of the job's ``etcd-v3`` rendezvous (``key=value,...``): files and a user,
    never a password (``etcd`` is the job's connection, :func:`job_etcd`), so it may go on the command line.

    A job in live recovery (``recovery: live``) gets ``recovery=live``: each torchrun then runs its own node's
    workers only and exports the live group's ``ETRAIN_LIVE_*`` to them, and the workers form the job-wide group
    under ``<key_prefix>/<run id>/live/`` with the job's etcd connection (``ETRAIN_ETCD_*``, set by
    :func:`worker_env`), which the job's etcd role reaches (``service.controller.identities``)."""
    spec = assignment.spec
    r = spec.rendezvous

    def absolute(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path else None

    conf = RendezvousConf(
        key_prefix=rdzv_prefix,
        last_call_timeout=r.last_call_timeout,
        join_timeout=r.join_timeout,
        node_ttl=r.node_ttl,
        connect_timeout=etcd.connect_timeout,
        recovery=spec.recovery,
        ca_cert=absolute(etcd.ca_cert),
        cert=absolute(etcd.cert),
        cert_key=absolute(etcd.cert_key),
        password_file=absolute(etcd.password_file) if etcd.user else None,
        user=etcd.user or None,
    )
    return conf.render(always=_ALWAYS_RENDERED)


def torchrun_command(
    assignment: Assignment,
    *,
    python: str,
    etcd_endpoints: str,
    rdzv_host: str | None,
    conf_on_command_line: str | None,
    forked: bool = False,
) -> list[str]:
    """``python -m torch.distributed.run ...`` for one generation (``conf_on_command_line`` None: no
    ``--rdzv-conf``; torchrun then reads ``PET_RDZV_CONF`` if its environment has one); ``forked``: torchrun forked
    from the zygote the environment names (:mod:`service.agent.zygotes`)."""
    spec = assignment.spec
    return TorchrunCommand(
        rdzv_endpoint=etcd_endpoints,
        run_id=assignment.rdzv_id,
        nnodes=f"{spec.min_nodes}:{spec.max_nodes}",
        entrypoint=spec.entrypoint,
        args=spec.args,
        module=spec.module,
        nproc_per_node=spec.nproc_per_node,
        rdzv_conf=conf_on_command_line,
        max_restarts=spec.restart_policy.max_worker_restarts,
        monitor_interval=0.5,
        local_addr=rdzv_host,
        prefork=spec.warm_start,
        python=python,
        forked=forked,
    ).argv()


def worker_env(
    assignment: Assignment,
    *,
    base: Mapping[str, str],
    node_name: str,
    progress_key: str,
    etcd: EtcdOptions,
    extra: Mapping[str, str] | None = None,
    socket_ifname: str | None = None,
    checkpoint_key_file: Path | None = None,
    home: Path | None = None,
) -> dict[str, str]:
    """torchrun's environment (inherited by the workers): base, extra, the node's collective interface,
    the spec's env, then the service's (:class:`elastic.contract.env.WorkerEnv`, replacing any inherited value).

    ``socket_ifname`` (the agent's ``--socket-ifname``) is the network interface the workers' collectives
    bind: it becomes ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, which a job's own env still overrides.
    ``checkpoint_key_file``: the job's manifest-signing key lies in that file (``ETRAIN_CHECKPOINT_KEY_FILE``) and
    is not put in the environment. ``home``: the job runs as a uid of its own (``service.agent.isolation``), with
    this ``HOME`` and a ``USER``/``LOGNAME`` of that uid (never the agent's).
    """
    spec = assignment.spec
    nic = {"GLOO_SOCKET_IFNAME": socket_ifname, "NCCL_SOCKET_IFNAME": socket_ifname} if socket_ifname else {}
    env = {**base, **(extra or {}), **nic, **spec.env}
    job = JobEnv(
        job_name=spec.name,
        generation=assignment.generation,
        node_name=node_name,
        progress_key=progress_key,
        lr_policy=spec.lr_policy.to_policy(),
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
    )
    WorkerEnv(
        job=job,
        job_id=assignment.job_id,
        checkpoint_url=assignment.checkpoint_url,
        local_snapshot_every=spec.local_snapshot_every,  # read by elastic.train.trainer; 0: off
        etcd=etcd,
        checkpoint_key=bytes.fromhex(assignment.checkpoint_key) if assignment.checkpoint_key else None,
        checkpoint_key_file=str(checkpoint_key_file) if checkpoint_key_file else None,
    ).apply(env)
    if home is not None:
        env["HOME"] = str(home)
        env["USER"] = env["LOGNAME"] = f"etrain-{assignment.job_id}"
    disable_shared_rdzv_store(env, override=True)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- processes -----------------------------------------------------------------------------------------
def _kill_same(procs: Sequence[tuple[int, int]], sig: int) -> None:
    """Signal processes that are still the ones recorded (same start time: no pid reuse)."""
    for pid, started in procs:
        st = process_stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class TorchrunProcess:
    """One torchrun process (and its workers) started by the agent."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self._popen = popen
        self.log_path = log_path
        self.started = time.time()

    @classmethod
    def start(
        cls, cmd: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path, user: JobUser | None = None
    ) -> TorchrunProcess:
        """Start ``cmd``, an interpreter and its arguments (:func:`torchrun_command`'s); with ``user`` as that uid
        and gid, without supplementary groups (the log is opened by the agent, 0600, and handed over as stdout: the
        job writes it, another job's uid cannot read it)."""
        log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # SIGTERM when the agent dies, armed by the job's own interpreter as the job's uid (a uid switch after it
        # would clear it; the agent's interpreter may be one the job's uid cannot run); no Python code runs between
        # fork and exec in a copy of this threaded process (no preexec_fn)
        argv = exec_with_parent_death_signal(cmd, signal.SIGTERM, env, python=cmd[0])
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "ab") as log:
            log.write(f"+ {' '.join(cmd)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=None if user is None else user.uid,
                group=None if user is None else user.gid,
                extra_groups=None if user is None else [],
            )
        return cls(popen, log_path)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def tree(self) -> list[tuple[int, int]]:
        """torchrun itself and its live descendants, as ``(pid, start time)``."""
        own = process_stat(self.pid)
        return ([(self.pid, own[1])] if own else []) + worker_tree(self.pid)

    def stop(self, grace: timedelta) -> int:
        """SIGTERM torchrun (it stops its workers and keeps the rendezvous open), SIGKILL what is left
        after ``grace``; returns torchrun's exit code."""
        tree = self.tree()
        if self._popen.poll() is None:
            try:
                self._popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self._popen.wait(timeout=grace.total_seconds())
            except subprocess.TimeoutExpired:
                tree += worker_tree(self.pid)
                logger.warning("torchrun %d ignored SIGTERM for %s; killing its tree", self.pid, grace)
                _kill_same(tree, signal.SIGKILL)
                self._popen.wait(timeout=10)
        # workers live in sessions of their own: make sure none outlives torchrun
        deadline = time.monotonic() + min(grace.total_seconds(), 5.0)
        while any(alive(*p) for p in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        _kill_same(tree[1:], signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(alive(*p) for p in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.02)  # SIGKILL is delivered asynchronously: report only when they are gone
        code = self._popen.returncode
        return int(code) if code is not None else -1

    def tail(self, max_chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(size - max_chars, 0))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        lines = text.splitlines()
        return "\n".join(lines[1:] if size > max_chars and len(lines) > 1 else lines)
