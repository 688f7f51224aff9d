"""The node agent: registers the node on a lease, runs one stock torchrun per assigned job generation.

The agent talks only to etcd, never to the controller, so it keeps running (and its jobs keep training)
while controllers restart or change leader. Its loop: read this node's assignments, stop torchruns whose
assignment vanished or changed generation, start torchruns for new ones, report exits, then wait for
the next assignment change (an etcd watch) or ``poll_interval``.

Reports (``reports/<node>/<job>``) say ``running`` (with the pid), ``exited`` (with the exit code and the
tail of the log), ``stopped`` (the agent stopped it) or ``launch_failed``. A generation that exited is
not started again on this node; only a new assignment (a new generation, or the node placed in the job again,
which live recovery does after dropping a node whose torchrun died) starts it.

With ``logs_port`` the agent also serves its jobs' logs to the controller (:mod:`service.agent.logs`), with a token
of this incarnation's that it publishes, with the address, in its node registration; with ``health_port``, its
``/healthz``. Both servers are :class:`~service.agent.endpoints.AgentEndpoints`'; this module is the loop.

The node key lives on the agent's lease: a SIGKILLed agent's node vanishes after ``lease_ttl``, and its
torchruns get SIGTERM at once from the kernel (parent-death signal). A clean stop (SIGTERM to the agent)
stops the workers and revokes the lease, so the node leaves at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal, Protocol

from elastic import prefork
from elastic.etcd import EtcdClient, EtcdError, create_client
from elastic.etcd.lease import LeaseKeeper
from service.agent.endpoints import AgentEndpoints, EndpointError
from service.agent.health import HealthStatus, judge_health
from service.agent.isolation import UidRangeExhausted
from service.agent.jobfiles import IsolationError, JobFiles
from service.agent.launcher import JobIdentityError, TorchrunProcess, rdzv_conf, torchrun_command, worker_env
from service.agent.logs import LogServer, log_path
from service.agent.zygotes import JobZygotes
from service.core.config import AgentSettings
from service.core.models import Assignment, NodeInfo, WorkerReport
from service.core.store import ServiceStore, create_store

logger = logging.getLogger(__name__)

__all__ = ["AgentError", "Launcher", "NodeAgent", "WorkerProcess", "create_agent"]


class AgentError(RuntimeError):
    """The agent cannot start (its node name is taken by a live agent)."""


class WorkerProcess(Protocol):
    """A started torchrun, as the agent handles it (:class:`~service.agent.launcher.TorchrunProcess`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        ...

    def stop(self, grace: timedelta) -> int:
        """Stop it (SIGTERM, then SIGKILL after ``grace``); return its exit code."""
        ...

    def tail(self) -> str:
        """The end of its log."""
        ...


Launcher = Callable[[Sequence[str], Mapping[str, str], str, Path], WorkerProcess]
"""Starts ``(command, environment, working directory, log path)``; raises ``OSError`` if it cannot. (A job that runs
as a uid of its own is always started by :meth:`TorchrunProcess.start`.)"""


@dataclass
class _Running:
    assignment: Assignment
    process: WorkerProcess


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _once(a: Assignment) -> tuple[str, int, datetime]:
    """What identifies one placement of a job on this node (see ``NodeAgent._finished``)."""
    return a.job_id, a.generation, a.assigned_at


class NodeAgent:
    """One node's agent; ``run(stop)`` blocks until ``stop`` is set, then stops its workers and leaves.

    ``launcher`` starts one torchrun (default :meth:`TorchrunProcess.start`); tests pass a fake.
    """

    def __init__(
        self, settings: AgentSettings, client: EtcdClient | None = None, *, launcher: Launcher | None = None
    ) -> None:
        self.settings = settings
        self._launcher: Launcher | None = launcher  # None: TorchrunProcess.start
        self._own_client = client is None
        self._etcd_config = settings.etcd.config()
        self.client = client or create_client(self._etcd_config)
        self.store: ServiceStore = create_store(self.client, settings.prefix)
        try:  # each job's private files and uid (service.agent.jobfiles)
            self._jobs = JobFiles(settings)
        except IsolationError as exc:
            if self._own_client:
                self.client.close()
            raise AgentError(str(exc)) from None
        self.isolation = self._jobs.isolation
        self._zygotes = JobZygotes(spare=settings.spare, stop_grace=settings.stop_grace)
        self.incarnation = uuid.uuid4().hex[:12]
        self._running: dict[str, _Running] = {}
        self._stopping: dict[str, _Running] = {}  # taken out of _running, stop() in progress
        # assignments whose torchrun ended (or never started): not started again while the same assignment
        # stays; a node the controller places again (a new ``assigned_at``, same generation: live recovery
        # dropped it after its torchrun died) starts anew
        self._finished: set[tuple[str, int, datetime]] = set()
        self._unsent: dict[str, WorkerReport] = {}
        self._keeper: LeaseKeeper | None = None
        # the job-log server (``settings.logs_port``) and its bearer token, and /healthz (``settings.health_port``,
        # while the loop runs)
        self._endpoints = AgentEndpoints(settings)
        self._last_loop = 0.0
        # _work serializes what the loop does (sync, reaping, shutdown), slow parts included: stopping a
        # torchrun (up to stop_grace and a kill) and etcd requests. _lock only guards the tables that
        # /healthz and running_jobs() read, and is never held across anything slow.
        self._work = threading.Lock()
        self._lock = threading.Lock()

    # -- registration --------------------------------------------------------------------------------
    def _node_info(self) -> NodeInfo:
        s = self.settings
        return NodeInfo(
            name=s.node_name,
            capacity=s.nproc_per_node,
            rdzv_host=s.rdzv_host,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            registered_at=_now(),
            lease_ttl=s.lease_ttl.total_seconds(),
            logs_url=self.logs_url,
            logs_token=self.logs_token if self.log_server is not None else None,
            spare=s.spare,
            isolation=self.isolation,
            owner=s.job_owner,
        )

    def _wait_name_free(self) -> None:
        key = self.store.keys.node(self.settings.node_name)
        deadline = time.monotonic() + self.settings.lease_ttl.total_seconds() + 2
        while True:
            kv, revision = self.client.get(key)
            if kv is None:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holder = json.loads(kv.value) if kv.value.startswith(b"{") else {}
                raise AgentError(
                    f"node name {self.settings.node_name!r} is registered by a live agent "
                    f"(pid {holder.get('pid')} on {holder.get('hostname')})"
                )
            logger.info("node name %s still registered (a previous agent?); waiting", self.settings.node_name)
            self.client.wait_for_event(key, revision + 1, timedelta(seconds=remaining))

    def register(self) -> None:
        """Claim the node name (waiting out a previous incarnation's lease), start serving the job logs
        (with ``logs_port``) and start heartbeats."""
        self._wait_name_free()
        if self.settings.spare:
            # held warm: a zygote of this agent's, torch imported, forks the workers of whatever job it joins
            # (elastic.prefork; the jobs' torchruns find it through ETRAIN_PREFORK_OWNER)
            prefork.prestart(os.getpid(), grace=self.settings.stop_grace.total_seconds())

        def attach(lease_id: int) -> None:
            self.store.register_node(self._node_info(), lease_id)

        self._start_logs()  # before the first registration, which names its address
        try:
            self._keeper = LeaseKeeper(self.client, self.settings.lease_ttl, on_new_lease=attach, name="agent")
        except BaseException:
            self._close_logs()
            raise
        logger.info(
            "agent %s registered (capacity %d, lease %ss)",
            self.settings.node_name,
            self.settings.nproc_per_node,
            self.settings.lease_ttl.total_seconds(),
        )

    # -- workers -------------------------------------------------------------------------------------
    def _report(self, report: WorkerReport) -> None:
        self._unsent[report.job_id] = report
        self._flush()

    def _flush(self) -> None:
        for job_id, report in list(self._unsent.items()):
            try:
                self.store.put_report(report)
                del self._unsent[job_id]
            except EtcdError as exc:
                logger.warning("cannot report %s/%s yet: %s", job_id, report.generation, exc)
                return

    def _forget_secrets(self, assigned: Iterable[str]) -> None:
        self._jobs.forget(assigned)

    def _launch(self, a: Assignment) -> None:
        s = self.settings
        log = log_path(s.work_dir, a.job_id, a.generation, s.node_name)
        base = WorkerReport(job_id=a.job_id, node=s.node_name, generation=a.generation, state="running")
        if s.job_owner and a.owner != s.job_owner:
            self._finished.add(_once(a))
            self._report(
                base.model_copy(
                    update={
                        "state": "launch_failed",
                        "error": f"this node runs only the jobs of {s.job_owner} (--job-owner), not of {a.owner}",
                    }
                )
            )
            return
        try:
            files = self._jobs.prepare(a)
        except (JobIdentityError, UidRangeExhausted, OSError) as exc:
            self._finished.add(_once(a))
            self._report(base.model_copy(update={"state": "launch_failed", "error": f"job identity: {exc}"}))
            return
        etcd = files.etcd
        env = worker_env(
            a,
            base=os.environ,
            node_name=s.node_name,
            progress_key=self.store.keys.progress_of(a.job_id),
            etcd=etcd,
            extra=s.extra_env,
            socket_ifname=s.socket_ifname,
            checkpoint_key_file=files.key_file,
            home=files.home,
        )
        zygote = self._zygotes.env_for(
            a.job_id, warm=a.spec.warm_start, own_uid=files.user is not None, own_launcher=self._launcher is not None
        )
        env.update(zygote)
        cmd = torchrun_command(
            a,
            python=s.python,
            etcd_endpoints=s.etcd.endpoints,
            rdzv_host=s.rdzv_host,
            conf_on_command_line=rdzv_conf(a, etcd, a.rdzv_prefix or self.store.keys.legacy_rdzv),
            forked=bool(zygote),
        )
        cwd = a.spec.working_dir or os.getcwd()
        if not Path(cwd).is_dir():
            self._finished.add(_once(a))
            self._report(
                base.model_copy(update={"state": "launch_failed", "error": f"working_dir {cwd} does not exist"})
            )
            return
        unreachable = self._jobs.unreachable_cwd(Path(cwd))
        if unreachable:  # the job's uid could not work there (and its workers would fail without a word)
            self._finished.add(_once(a))
            self._report(
                base.model_copy(
                    update={
                        "state": "launch_failed",
                        "error": f"working_dir {cwd}: the job's uid cannot enter it: {unreachable}",
                    }
                )
            )
            return
        try:
            if self._launcher is None:
                proc: WorkerProcess = TorchrunProcess.start(cmd, env, cwd, log, user=files.user)
            elif files.user is None:
                proc = self._launcher(cmd, env, cwd, log)
            else:
                raise OSError("this agent's launcher cannot run a job as a uid of its own")
        except OSError as exc:
            self._finished.add(_once(a))
            self._report(base.model_copy(update={"state": "launch_failed", "error": f"cannot start torchrun: {exc}"}))
            return
        with self._lock:
            self._running[a.job_id] = _Running(a, proc)
        logger.info(
            "job %s generation %d: torchrun pid %d, log %s%s",
            a.job_id,
            a.generation,
            proc.pid,
            log,
            f", uid {files.user.uid}" if files.user else "",
        )
        self._report(base.model_copy(update={"pid": proc.pid, "started_at": _now()}))

    def _launch_isolated(self, a: Assignment) -> None:
        """:meth:`_launch`, where whatever one job's assignment makes fail (a value no process can be given, a
        path the kernel refuses, a bug met only by that spec) fails that job alone: reported ``launch_failed``
        (the leader turns it into the job's event) and not retried, while the agent and its other jobs go on."""
        try:
            self._launch(a)
        except EtcdError:
            raise  # the loop's to handle: etcd is unavailable, not the job's fault
        except Exception as exc:
            with self._lock:
                started = a.job_id in self._running  # it failed after its torchrun started: that runs on
            if started:
                logger.exception("job %s generation %d: after its start", a.job_id, a.generation)
                return
            logger.exception("job %s generation %d: cannot be launched", a.job_id, a.generation)
            self._finished.add(_once(a))
            error = f"cannot launch: {type(exc).__name__}: {str(exc)[:500]}"
            self._report(
                WorkerReport(
                    job_id=a.job_id,
                    node=self.settings.node_name,
                    generation=a.generation,
                    state="launch_failed",
                    error=error,
                )
            )

    def _stop(self, job_id: str, reason: str, *, planned: bool = False) -> None:
        """Stop one torchrun; the caller holds ``_work``. Waiting for it happens without ``_lock``, so
        /healthz answers (and counts it as stopping) meanwhile."""
        with self._lock:
            run = self._running.pop(job_id)
            self._stopping[job_id] = run
        a = run.assignment
        logger.info(
            "job %s generation %d: stopping torchrun pid %d (%s)",
            job_id,
            a.generation,
            run.process.pid,
            reason,
        )
        try:
            code = run.process.stop(self.settings.stop_grace)
        finally:
            self._last_loop = time.monotonic()  # the loop was busy, not stuck
            with self._lock:
                del self._stopping[job_id]
        self._finished.add(_once(a))
        self._report(self._final_report(run, "stopped", code, reason, planned=planned))

    def _final_report(
        self,
        run: _Running,
        state: Literal["exited", "stopped"],
        code: int | None,
        error: str | None,
        planned: bool = False,
    ) -> WorkerReport:
        """What a generation that has ended (by itself, or stopped by this agent) is reported as."""
        a = run.assignment
        return WorkerReport(
            job_id=a.job_id,
            node=self.settings.node_name,
            generation=a.generation,
            state=state,
            pid=run.process.pid,
            exit_code=code,
            finished_at=_now(),
            error=error,
            planned=planned,
        )

    def _reap(self) -> None:
        for job_id, run in list(self._running.items()):
            code = run.process.poll()
            if code is None:
                continue
            with self._lock:
                del self._running[job_id]
            a = run.assignment
            self._finished.add(_once(a))
            logger.info("job %s generation %d: torchrun exited with %d", job_id, a.generation, code)
            self._report(self._final_report(run, "exited", code, run.process.tail() if code != 0 else None))

    def sync(self, assignments: dict[str, Assignment]) -> None:
        """Make the running torchruns match ``assignments`` (one pass of the loop, without waiting)."""
        with self._work:
            self._reap()
            for job_id, run in list(self._running.items()):
                wanted = assignments.get(job_id)
                if wanted is None:
                    self._stop(job_id, "unassigned")
                elif wanted.generation != run.assignment.generation:
                    self._stop(job_id, f"replaced by generation {wanted.generation}")
            for job_id, a in sorted(assignments.items()):
                if job_id not in self._running and _once(a) not in self._finished:
                    self._launch_isolated(a)
            self._finished = {f for f in self._finished if f[0] in assignments}
            self._forget_secrets(assignments)
            self._zygotes.forget({*assignments, *self._running, *self._stopping})
            self._flush()

    # -- loop ----------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Register, then serve assignments until ``stop`` is set; finally stop workers and leave."""
        if self._keeper is None:
            self.register()
        self._start_health()
        poll = self.settings.poll_interval
        prefix = self.store.keys.assignments_of(self.settings.node_name)
        try:
            while not stop.is_set():
                self._last_loop = time.monotonic()
                try:
                    assignments, revision = self.store.assignments(self.settings.node_name)
                    self.sync(assignments)
                    self.client.wait_for_event(prefix, revision + 1, poll, prefix=True)
                except EtcdError as exc:
                    logger.warning(
                        "agent %s: etcd unavailable (%s); workers keep running", self.settings.node_name, exc
                    )
                    with self._work:
                        self._reap()
                    stop.wait(poll.total_seconds())
                except Exception:  # a bug in a pass must not end the agent (and every job of the node) with it
                    logger.exception("agent %s: this pass failed; workers keep running", self.settings.node_name)
                    stop.wait(poll.total_seconds())
        finally:
            self.shutdown()

    def runs(self, job_id: str, generation: int) -> bool:
        """Whether this generation of the job has a torchrun here (running, or being stopped): its log may grow."""
        with self._lock:
            run = self._running.get(job_id) or self._stopping.get(job_id)
            return run is not None and run.assignment.generation == generation

    def running_jobs(self) -> dict[str, int]:
        """job id -> torchrun pid, for the jobs this agent runs now."""
        with self._lock:
            return {j: r.process.pid for j, r in self._running.items()}

    def shutdown(self) -> None:
        """Stop every torchrun (workers keep their rendezvous open), revoke the lease, stop serving."""
        with self._work:
            for job_id in list(self._running):
                try:
                    self._stop(job_id, "agent shutting down", planned=True)
                except Exception:
                    logger.exception("stopping job %s failed", job_id)
            self._forget_secrets(())
            self._zygotes.close()
        if self._keeper is not None:
            self._keeper.close(revoke=True)
            self._keeper = None
        self._endpoints.stop_health()
        self._close_logs()  # after the torchruns stopped: followed logs have ended
        if self._own_client:
            self.client.close()

    # -- job logs and /healthz (service.agent.endpoints) ----------------------------------------------
    @property
    def logs_token(self) -> str:
        """The bearer token of this incarnation's job-log server (published in the node's registration)."""
        return self._endpoints.logs_token

    @property
    def log_server(self) -> LogServer | None:
        """The server of this node's job logs (``--logs-port``), None while it does not run."""
        return self._endpoints.logs

    @property
    def logs_url(self) -> str | None:
        """Where the controller reaches this agent's log server (:attr:`AgentEndpoints.logs_url`)."""
        return self._endpoints.logs_url

    def _start_logs(self) -> None:
        try:
            self._endpoints.start_logs(self.runs)
        except EndpointError as exc:
            raise AgentError(str(exc)) from exc.__cause__

    def _close_logs(self) -> None:
        self._endpoints.close_logs()

    def healthy(self) -> HealthStatus:
        """(ok, body) for /healthz (:func:`~service.agent.health.judge_health`): never waits for the loop's work
        (a torchrun being stopped, etcd)."""
        with self._lock:
            running, stopping = len(self._running), len(self._stopping)
        return judge_health(
            self.settings.node_name,
            registered=self._keeper is not None,
            running=running,
            stopping=stopping,
            since_loop_s=time.monotonic() - self._last_loop,
            lease_ttl_s=self.settings.lease_ttl.total_seconds(),
        )

    def _start_health(self) -> None:
        self._endpoints.start_health(self.healthy)


def create_agent(
    settings: AgentSettings, client: EtcdClient | None = None, *, launcher: Launcher | None = None
) -> NodeAgent:
    return NodeAgent(settings, client, launcher=launcher)
