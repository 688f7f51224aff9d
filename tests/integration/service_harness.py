"""A whole service on loopback for integration tests: real etcd, controller and agents as processes.

Processes are started with ``python -m service.cli`` exactly as an operator would, so tests can SIGKILL
and restart any of them.

With ``network`` (a :class:`~tests.integration.netns.NetnsTopology`) the cluster must be built by a process
running in the topology's hub namespace: etcd listens on the hub's bridge address, the controller on the
hub's loopback, and each agent runs in its node's namespace (``ip netns exec``), advertising the node's
address (``--rdzv-host``, torchrun's ``--local-addr``) and binding its workers' collectives to the node's
interface (``--socket-ifname``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.etcd import create_client
from elastic.proctree import descendants
from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from service.cli.client import ApiClient
from service.core.models import WorkerReport
from service.core.store import Keys
from tests.integration.netns import NetnsTopology

ROOT = Path(__file__).resolve().parents[2]
DEMO_JOB = ROOT / "examples" / "demo_job.py"


def job_spec(steps: int, *, step_time: float = 0.1, min_nodes: int = 2, max_nodes: int = 3) -> dict[str, Any]:
    return {
        "name": "itest",
        "entrypoint": str(DEMO_JOB),
        "args": ["--steps", str(steps), "--checkpoint-every", "10", "--step-time", str(step_time)],
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "rendezvous": {"last_call_timeout": 1},
        "restart_policy": {"backoff_initial": 1},
    }


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # the controller may be restarting
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class ServiceCluster:
    def __init__(
        self,
        workdir: Path,
        prefix: str = "/etrain",
        lease_ttl: float = 2.0,
        etcd_members: int = 1,
        network: NetnsTopology | None = None,
    ) -> None:
        self.workdir = workdir
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

    def _spawn(self, name: str, args: list[str], prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        (self.workdir / "logs").mkdir(exist_ok=True)
        with open(self.workdir / "logs" / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [
                    *(prefix or []),  # `ip netns exec NS` execs the program: the pid stays the agent's
                    sys.executable,
                    "-m",
                    "service.cli",
                    *args,
                    "--etcd",
                    self.etcd.endpoints,
                    "--prefix",
                    self.prefix,
                ],
                env=env,
                cwd=str(self.workdir),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start_controller(self) -> ApiClient:
        port = free_port()
        self.controller = self._spawn(
            "controller",
            [
                "controller",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--leader-ttl",
                str(self.lease_ttl),
                "--checkpoint-root",
                f"file://{self.checkpoint_root}",
            ],
        )
        self.url = f"http://127.0.0.1:{port}"
        api = ApiClient(self.url)
        wait_for("the controller to be ready", api.ready, 60)
        return api

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait()

    def start_agent(self, name: str) -> None:
        args = ["agent", "--node-name", name, "--work-dir", str(self.workdir / "agents" / name),
                "--lease-ttl", str(self.lease_ttl)]  # fmt: skip
        if self.network is None:
            self.agents[name] = self._spawn(name, [*args, "--rdzv-host", "127.0.0.1"])
            return
        node = self.network.nodes[name]
        args += ["--rdzv-host", node.address, "--socket-ifname", node.ifname]
        self.agents[name] = self._spawn(name, args, prefix=self.network.node_prefix(name))

    def kill_agent(self, name: str) -> None:
        proc = self.agents[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def reports(self, job_id: str) -> dict[str, WorkerReport]:
        client = create_client(self.etcd.config())
        try:
            kvs, _ = client.get_prefix(self.keys.reports_of(job_id))
        finally:
            client.close()
        return {r.node: r for kv in kvs if (r := WorkerReport.model_validate_json(kv.value))}

    def job_processes(self, job_id: str) -> list[tuple[int, int]]:
        """``(pid, start time)`` of every torchrun of the job and their workers, from the agents' reports."""
        procs: list[tuple[int, int]] = []
        for r in self.reports(job_id).values():
            if r.state == "running" and r.pid:
                stat = Path(f"/proc/{r.pid}/stat")
                if stat.exists():
                    procs.append((r.pid, int(stat.read_text().rsplit(")", 1)[1].split()[19])))
                    procs += descendants(r.pid)
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


def alive(proc: tuple[int, int]) -> bool:
    """The process still runs and is the one recorded (same start time), not a zombie."""
    try:
        fields = Path(f"/proc/{proc[0]}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[19]) == proc[1]
