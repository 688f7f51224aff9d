"""A whole service on one machine: real etcd, the controller and node agents as separate processes.

Processes are started with ``python -m service.cli`` exactly as an operator would, so a caller can
SIGKILL and restart any of them. ``etrain demo`` and the integration and chaos suites use this one
harness.

With ``network`` (a :class:`Network`, e.g. the test suite's network-namespace topology) the cluster must
be built by a process running in the topology's hub namespace: etcd listens on the hub's address, the
controller on the hub's loopback, and each agent runs in its node's namespace (``ip netns exec``),
advertising the node's address (``--rdzv-host``, torchrun's ``--local-addr``) and binding its workers'
collectives to the node's interface (``--socket-ifname``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from elastic import compat
from elastic.contract import env as worker_env
from elastic.etcd import create_client
from elastic.prefork.common import worker_tree
from elastic.proctree import process_stat
from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from elastic.testing.torchrun import shared_zygote
from elastic.testing.wait import wait_for
from service.client import ApiClient, ApiError
from service.core.keys import DEFAULT_PREFIX
from service.core.models import WorkerReport
from service.core.store import Keys

__all__ = ["REPO", "LocalServiceCluster", "Network", "NetworkNode"]

REPO = Path(__file__).resolve().parents[2]


class NetworkNode(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def ifname(self) -> str: ...


class Network(Protocol):
    """Where the cluster's processes live when they do not all share loopback."""

    @property
    def hub_address(self) -> str: ...

    @property
    def nodes(self) -> Mapping[str, NetworkNode]: ...

    def node_prefix(self, name: str) -> list[str]: ...


class LocalServiceCluster:
    """etcd, one controller and any number of agents under ``workdir`` (logs in ``workdir/logs``)."""

    def __init__(
        self,
        workdir: Path,
        prefix: str = DEFAULT_PREFIX,
        lease_ttl: float = 2.0,
        etcd_members: int = 1,
        network: Network | None = None,
        shared_zygote: bool = False,
    ) -> None:
        self.workdir = workdir
        # the jobs of every agent in this process's network namespace, not a spare and with no flags of its own
        # (job uids), fork their workers from one zygote of this process's (elastic.prefork,
        # ETRAIN_PREFORK_OWNER): one torch import for a suite's jobs instead of one per torchrun. Not for
        # benchmarks of start-up, nor where agents stand for separate hosts (``network``).
        self.shared_zygote = shared_zygote
        self.prefix = prefix
        self.lease_ttl = lease_ttl
        self.network = network
        (workdir / "etcd").mkdir(parents=True, exist_ok=True)
        host = network.hub_address if network is not None else "127.0.0.1"
        self.etcd = LocalEtcdCluster(etcd_members, host=host, workdir=workdir / "etcd").start()
        self.controller: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.url = ""
        self.keys = Keys(prefix)
        self.checkpoint_root = workdir / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def _spawn(
        self, name: str, args: Sequence[str], prefix: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        # the caller's own service settings (ETRAIN_*: server, token, prefix ...) must not leak in
        env = {k: v for k, v in os.environ.items() if not k.startswith(worker_env.PREFIX)}
        env.update(extra_env or {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        compat.disable_shared_rdzv_store(env, override=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "service.cli",
            *args,
            "--etcd",
            self.etcd.endpoints,
            "--prefix",
            self.prefix,
        ]  # `ip netns exec NS` execs: the pid stays the process's
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                cmd, env=env, cwd=str(self.workdir), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def start_controller(
        self, ready_timeout: float = 60, *, tokens: Mapping[str, str] | None = None, extra_args: Sequence[str] = ()
    ) -> ApiClient:
        """Start the controller; ``tokens`` (token -> role, each named after its role) turns authentication on
        (``--tokens-file``) and the client returned holds the first admin token."""
        port = free_port()
        args = [
            "controller",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--leader-ttl",
            str(self.lease_ttl),
            "--checkpoint-root",
            f"file://{self.checkpoint_root}",
            *extra_args,
        ]
        admin = None
        if tokens is not None:
            tokens_file = self.workdir / "tokens.json"
            tokens_file.write_text(
                json.dumps({"tokens": [{"token": t, "role": r, "name": r} for t, r in tokens.items()]})
            )
            tokens_file.chmod(0o600)
            args += ["--tokens-file", str(tokens_file)]
            admin = next((t for t, r in tokens.items() if r == "admin"), None)
        self.controller = self._spawn("controller", args)
        self.url = f"http://127.0.0.1:{port}"
        api = ApiClient(self.url, token=admin)
        wait_for(
            lambda: self.check_alive() and api.ready(),
            ready_timeout,
            0.5,
            what="the controller to be ready",
            retry_on=(ApiError,),
        )
        return api

    def check_alive(self) -> bool:
        """True while the controller (once started) and every agent not killed on purpose run; else
        ``RuntimeError`` naming the processes that exited and where their logs are."""
        dead = [name for name, p in self.agents.items() if p.poll() is not None and p.returncode != -signal.SIGKILL]
        if self.controller is not None and self.controller.poll() is not None:
            if self.controller.returncode != -signal.SIGKILL:
                dead.append("controller")
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited early: see {self.logs}")
        return True

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait()

    def start_agent(
        self, name: str, nproc_per_node: int | None = None, *, spare: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        """Start agent ``name`` (its job logs served on a free port, for ``etrain logs``; ``spare``: a hot
        spare; ``extra_args``: more ``etrain agent`` flags)."""
        args = [
            "agent",
            "--node-name",
            name,
            "--work-dir",
            str(self.workdir / "agents" / name),
            "--lease-ttl",
            str(self.lease_ttl),
            "--logs-port",
            str(free_port()),
        ]
        if nproc_per_node is not None:
            args += ["--nproc-per-node", str(nproc_per_node)]
        if spare:
            args.append("--spare")
        args += extra_args
        # inherited by torchrun and its workers: elastic/testing/train_worker.py records it ("agent") with each step
        env = {"TEST_AGENT_NAME": name}
        if self.shared_zygote and self.network is None and not spare and not extra_args:
            env.update(shared_zygote())
        if self.network is None:
            self.agents[name] = self._spawn(name, [*args, "--rdzv-host", "127.0.0.1"], extra_env=env)
            return
        node = self.network.nodes[name]
        args += ["--rdzv-host", node.address, "--socket-ifname", node.ifname]
        self.agents[name] = self._spawn(name, args, prefix=self.network.node_prefix(name), extra_env=env)

    def kill_agent(self, name: str) -> None:
        proc = self.agents[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def reports(self, job_id: str) -> dict[str, WorkerReport]:
        client = create_client(self.etcd.config())
        try:
            kvs, _ = client.get_prefix(self.keys.reports)
        finally:
            client.close()
        return {r.node: r for kv in kvs if (r := WorkerReport.model_validate_json(kv.value)).job_id == job_id}

    def job_processes(self, job_id: str) -> list[tuple[int, int]]:
        """``(pid, start time)`` of every torchrun of the job and their workers (also those a zygote forked), from
        the agents' reports."""
        procs: list[tuple[int, int]] = []
        for r in self.reports(job_id).values():
            if r.state == "running" and r.pid and (st := process_stat(r.pid)) is not None:
                procs.append((r.pid, st[1]))
                procs += worker_tree(r.pid)  # with the workers a zygote forked
        return procs

    def stop(self) -> None:
        procs = [p for p in (*self.agents.values(), self.controller) if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.etcd.stop()
