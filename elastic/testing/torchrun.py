"""Launch stock torchrun agents as real process trees and inject faults into them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import compat
from elastic.contract.env import PREFORK_OWNER
from elastic.prefork import forked_worker, worker_tree
from elastic.torchrun_cli import COLD, FORKED, TorchrunCommand, format_rdzv_conf

WORKER = str(Path(__file__).with_name("allreduce_worker.py"))


def torchrun_command(
    *,
    backend: str,
    endpoint: str,
    run_id: str,
    nnodes: str,
    nproc: int = 1,
    rdzv_conf: dict[str, object] | None = None,
    max_restarts: int = 3,
    script: str = WORKER,
    script_args: Sequence[str] = (),
    local_addr: str = "127.0.0.1",
    monitor_interval: float = 0.1,
    prefork: bool = False,
) -> list[str]:
    """A test or benchmark agent's torchrun (any rendezvous backend; the test worker by default)."""
    return TorchrunCommand(
        rdzv_endpoint=endpoint,
        run_id=run_id,
        nnodes=nnodes,
        entrypoint=script,
        args=script_args,
        nproc_per_node=nproc,
        rdzv_backend=backend,
        rdzv_conf=format_rdzv_conf(rdzv_conf) if rdzv_conf else None,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        local_addr=local_addr,
        prefork=prefork,
    ).argv()


def shared_zygote() -> dict[str, str]:
    """The environment that has warm (``prefork=True``) agents fork their workers from one zygote owned by this
    process (``ETRAIN_PREFORK_OWNER``, as a hot spare's node agent does for the jobs it joins) instead of one
    zygote per agent: a test process starting many agents imports torch for their workers once. The zygote exits
    with this process; a killed agent's workers are still killed with it (:meth:`TorchrunAgent.kill_tree`)."""
    return {PREFORK_OWNER: str(os.getpid())}


def forked_command(cmd: list[str]) -> list[str]:
    """``cmd`` (a ``python -m torch.distributed.run ...`` command) as a prefork client whose child, forked from
    the shared zygote, runs that torchrun (:mod:`elastic.prefork.torchrun`)."""
    if cmd[1:3] != list(COLD):
        raise ValueError(f"not a `python -m torch.distributed.run` command: {cmd[:3]}")
    return [cmd[0], *FORKED, *cmd[3:]]


@dataclass
class TorchrunAgent:
    """One torchrun agent and its workers, in a process group of their own.

    ``forked``: the agent itself is forked from this process's zygote (:func:`shared_zygote`, which its workers
    use too) instead of starting a fresh interpreter that imports torch: :attr:`process` is then the prefork
    client, which forwards signals to torchrun and exits as it does, and :attr:`agent_pid` is torchrun's pid."""

    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    forked: bool = False

    def start(self) -> TorchrunAgent:
        env = dict(os.environ)
        compat.disable_shared_rdzv_store(env)  # for the c10d baselines too: the same setting as etcd-v3
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.forked:
            env.update(shared_zygote())
        env.update(self.env)
        cmd = forked_command(self.cmd) if self.forked else self.cmd
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        """The process this harness started (for a forked agent, the prefork client)."""
        assert self.process is not None
        return self.process.pid

    @property
    def agent_pid(self) -> int | None:
        """torchrun's pid: :attr:`pid`, or for a forked agent the child the zygote forked (None until it is)."""
        return forked_worker(self.pid) if self.forked else self.pid

    def kill_tree(self, sig: int = signal.SIGKILL) -> float:
        """Signal the agent and every descendant (torchrun puts workers in sessions of their own, so a
        process-group kill would miss them); returns the time of the kill."""
        if self.process is None or self.process.poll() is not None:
            return time.time()
        return kill_tree(self.process.pid, sig)

    def kill_workers(self, sig: int = signal.SIGKILL) -> float:
        """Signal the agent's workers only (a worker crash); the agent lives on."""
        if self.process is None:
            return time.time()
        now = time.time()
        agent = self.agent_pid
        for pid, _ in worker_tree(agent) if agent is not None else []:
            _signal(pid, sig)
        return now

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is None:
            return
        self.kill_tree(signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_tree(root: int, sig: int = signal.SIGKILL) -> float:
    """Freeze ``root`` (so it spawns nothing new) and the descendants it has, then signal it and all its
    descendants. A ``root`` that is a prefork client (a forked agent) is frozen with the process it runs; that process
    is signalled directly and the client, which would forward the signal a second time, only by SIGKILL.

    The descendants are found by a walk over ``/proc`` that takes seconds on a loaded machine: they are frozen at
    once from a first walk, before the agent's frozen seconds cost it its rendezvous lease (its peers' agents would
    re-form and have their workers save while this node's still ran: no node loss at all); a second walk, with all
    of them frozen, finds what was spawned in between."""
    forked = forked_worker(root)
    before = [p for p, _ in worker_tree(root)]
    frozen = [root] if forked is None else [root, forked]
    for pid in [*frozen, *before]:
        _signal(pid, signal.SIGSTOP)
    now = time.time()
    tree = list(dict.fromkeys([*before, *(p for p, _ in worker_tree(root))]))
    own = [root] if forked is None or sig == signal.SIGKILL else []
    for pid in [*own, *tree]:
        _signal(pid, sig)
    if sig != signal.SIGKILL:
        for pid in dict.fromkeys([*frozen, *tree]):
            _signal(pid, signal.SIGCONT)
    return now


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out
