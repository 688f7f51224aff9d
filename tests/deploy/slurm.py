"""A real Slurm on this machine for the HPC scripts' tests: munged, one ``slurmctld`` and ``nodes`` ``slurmd -N nX``,
each with its own port and spool directory, all on 127.0.0.1 and all of them started and stopped by the test.

What it needs is installed by ``scripts/setup.sh`` (Debian's ``slurm-wlm`` and ``munge``). :func:`missing` says in
one line what is not there, so that a test fails saying so instead of being skipped in silence.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic.testing.etcd_server import free_port

__all__ = ["LocalSlurm", "missing"]

_PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scancel", "squeue")


def missing() -> str | None:
    """What this machine lacks for a local Slurm, in one line; None when nothing."""
    absent = [p for p in _PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if absent:
        return f"Slurm is not installed here ({', '.join(absent)} missing): run scripts/setup.sh (apt slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd starts jobs as their users)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no user 'munge' (the munge package makes it): run scripts/setup.sh"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package makes it): run scripts/setup.sh"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class LocalSlurm:
    """``start()`` brings the cluster up (every node idle); ``stop()`` cancels every job and stops every daemon it
    started. ``env`` is what a client (sbatch, srun, sinfo) needs: ``SLURM_CONF``."""

    workdir: Path
    nodes: int = 3
    slurmd_timeout: int = 30
    # a step credential's lifetime, which is also how long Slurm holds a requeued job (None: Slurm's 120 s)
    cred_expire: int | None = None
    # how long slurmctld waits on one RPC (None: Slurm's 10 s); a ping to a lost node waits this long
    message_timeout: int | None = None
    names: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _munge_dir: Path | None = None

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> LocalSlurm:
        problem = missing()
        if problem:
            raise RuntimeError(problem)
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        w.chmod(0o755)
        # munged's own directory: every directory above it must be searchable by the munge user (pytest's are
        # root's 0700), and its socket's path short (108 bytes at most)
        munge_dir = self._munge_dir = Path(tempfile.mkdtemp(prefix="etrain-munge-"))
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o711)  # munged: its socket's directory must be searchable by all
        self.names = [f"n{i + 1}" for i in range(self.nodes)]
        socket_path = munge_dir / "munge.sock"
        self._write_conf(socket_path)
        # munged as its own user, on a socket of its own (the system's munged, if any, is left alone)
        self._run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                _sbin("munged"),
                "-F",
                f"--socket={socket_path}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'seed'}",
                "--key-file=/etc/munge/munge.key",
            ],
            "munged",
        )
        self._wait(lambda: socket_path.exists(), 10, "munged did not create its socket")
        self._run([_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in self.names:
            (w / "spool" / name).mkdir(parents=True, exist_ok=True)
            self._run([_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
        self._wait(
            lambda: self.idle_nodes() == set(self.names),
            timeout,
            f"the nodes did not come up idle (sinfo: {self.sinfo()!r}); see {w}/*.log",
        )
        return self

    def _write_conf(self, socket_path: Path) -> None:
        w = self.workdir
        ports = [free_port() for _ in range(self.nodes + 1)]
        lines = [
            "ClusterName=etrain-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}" + (f",cred_expire={self.cred_expire}" if self.cred_expire else ""),
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}",
            f"SlurmdPidFile={w / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={w / 'slurmctld.log'}",
            f"SlurmdLogFile={w / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            # a pending job whose begin time passed (a requeued job after its hold) starts at the next scheduling
            # pass, not an event's: every second here, not after Slurm's 30 s (backfill) or 60 s (main loop)
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SelectType=select/linear",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout}",
            *([f"MessageTimeout={self.message_timeout}"] if self.message_timeout else []),
            "KillWait=10",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
        ]
        for name, port in zip(self.names, ports[1:], strict=True):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        (w / "state").mkdir(exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def _run(self, argv: list[str], name: str) -> None:
        log = open(self.workdir / f"{name}.out", "ab")
        self._procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        log.close()

    @staticmethod
    def _wait(predicate: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():  # type: ignore[operator]
                return
            time.sleep(0.3)
        raise TimeoutError(what)

    def sinfo(self) -> str:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env, timeout=30
        )
        return done.stdout.strip()

    def node_state(self, name: str) -> str:
        """Slurm's short state of one node (``idle``, ``alloc``, ``down*``, ...)."""
        states = dict(line.split() for line in self.sinfo().splitlines() if len(line.split()) == 2)
        return states.get(name, "")

    def kill_node(self, name: str, also: list[int]) -> None:
        """A node dies: its slurmd and the processes ``also`` (its tasks, their slurmstepd) get SIGKILL at once."""
        daemon = next(p for p, n in zip(self._procs[2:], self.names, strict=True) if n == name)
        for pid in [daemon.pid, *also]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.wait(timeout=10)

    def idle_nodes(self) -> set[str]:
        states = dict(line.split() for line in self.sinfo().splitlines() if len(line.split()) == 2)
        return {n for n, s in states.items() if s == "idle"}

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit; returns the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**self.env, **(env or {})},
            cwd=cwd,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=30
        )
        return done.stdout.strip() or "GONE"

    def _jobs(self) -> list[str]:
        done = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env, timeout=30)
        return done.stdout.split()

    def scancel(self, job_id: str, *args: str) -> None:
        subprocess.run(["scancel", *args, job_id], env=self.env, timeout=30, check=False)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, timeout=30, check=False, capture_output=True)
        try:  # the jobs' processes end through their slurmstepd (SIGTERM, then SIGKILL after KillWait)
            self._wait(lambda: not self._jobs(), 30, "jobs still there")
        except (TimeoutError, subprocess.SubprocessError, OSError):
            pass
        for proc in reversed(self._procs):  # the slurmds (and their steps' slurmstepd), slurmctld, munged
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self._procs.clear()
        for stepd in _stepds(self.workdir):  # a step's slurmstepd runs in a session of its own
            try:
                os.kill(stepd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
            self._munge_dir = None


def _stepds(workdir: Path) -> list[int]:
    """The pids of slurmstepd processes of this cluster (their command line names its spool directory's node)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isascii() or not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"slurmstepd") and str(workdir).encode() in environ:
            out.append(int(entry.name))
    return out
