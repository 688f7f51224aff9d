"""``etrain demo``: a whole cluster on one machine, a job, a node killed mid-run, the job recovering.

Starts a local etcd, the controller and three node agents (as separate processes, exactly as in
production but on loopback), submits ``examples/demo_job.py`` on 2..3 nodes, SIGKILLs one agent once
the job has committed a checkpoint at world size 3, follows the job as it re-forms on two nodes and
finishes, then prints the world-size history and where the checkpoints are. Everything lives under
``--workdir`` (default ``.demo``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from service.cli.client import ApiClient, ApiError
from service.cli.render import event_line, job_text, progress_line

__all__ = ["demo_job_spec", "run_demo", "snapshot_sizes"]

_REPO = Path(__file__).resolve().parents[2]
_NODES = ("node-1", "node-2", "node-3")


def demo_job_spec(steps: int = 150, step_time: float = 0.1) -> dict[str, Any]:
    """The demo's job: 2..3 nodes x 1 process of the CPU demo job."""
    return {
        "name": "demo",
        "entrypoint": str(_REPO / "examples" / "demo_job.py"),
        "args": ["--steps", str(steps), "--checkpoint-every", "10", "--step-time", str(step_time)],
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        "nproc_per_node": 1,
        "min_nodes": 2,
        "max_nodes": 3,
        "lr_policy": {"scaling": "linear", "base_lr": 0.02, "base_world_size": 1},
        "restart_policy": {"max_failures": 3, "backoff_initial": 1},
        "rendezvous": {"last_call_timeout": 2},
    }


@dataclass
class _Cluster:
    workdir: Path
    etcd: LocalEtcdCluster | None = None
    controller: subprocess.Popen[bytes] | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = 0

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        for name in ("ETRAIN_TOKEN", "ETRAIN_TOKENS_FILE", "ETRAIN_PREFIX", "ETRAIN_SERVER"):
            env.pop(name, None)
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "service.cli", *args],
                env=self.env(),
                cwd=str(_REPO),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start(self) -> None:
        (self.workdir / "etcd").mkdir(parents=True, exist_ok=True)
        self.etcd = LocalEtcdCluster(1, workdir=self.workdir / "etcd").start()
        endpoints = self.etcd.endpoints
        self.port = free_port()
        self.controller = self._spawn(
            "controller",
            [
                "controller",
                "--etcd",
                endpoints,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--checkpoint-root",
                f"file://{self.workdir / 'checkpoints'}",
                "--leader-ttl",
                "3",
            ],
        )
        for node in _NODES:
            self.agents[node] = self._spawn(
                node,
                [
                    "agent",
                    "--etcd",
                    endpoints,
                    "--node-name",
                    node,
                    "--nproc-per-node",
                    "1",
                    "--work-dir",
                    str(self.workdir / "agents" / node),
                    "--rdzv-host",
                    "127.0.0.1",
                    "--lease-ttl",
                    "3",
                ],
            )

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
        if self.etcd is not None:
            self.etcd.stop()


def snapshot_sizes(ckpt_dir: Path) -> list[tuple[str, int]]:
    """Each entry of a job's checkpoint directory with its size: a snapshot (a directory) counts the bytes
    of every file in it, not its directory entry."""
    if not ckpt_dir.exists():
        return []
    sizes = []
    for path in sorted(ckpt_dir.iterdir()):
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        sizes.append((path.name + ("/" if path.is_dir() else ""), sum(f.stat().st_size for f in files)))
    return sizes


def _wait(what: str, check: Callable[[], bool], timeout: float, cluster: _Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [n for n, p in cluster.agents.items() if p.poll() is not None]
        if cluster.controller is not None and cluster.controller.poll() is not None:
            dead.append("controller")
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited early: see {cluster.logs}")
        try:
            if check():
                return
        except ApiError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}: see {cluster.logs}")


def _say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run_demo(workdir: Path, keep: bool = False, steps: int = 150) -> int:
    """Run the demo (see the module docstring); 0 when the job recovered and succeeded."""
    started = time.monotonic()
    for sub in ("etcd", "logs", "agents", "checkpoints"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = _Cluster(workdir)
    try:
        _say(f"starting etcd, the controller and 3 node agents (logs in {cluster.logs})")
        cluster.start()
        assert cluster.etcd is not None
        api = ApiClient(f"http://127.0.0.1:{cluster.port}")
        print(f"    etcd        {cluster.etcd.endpoints}")
        print(f"    controller  http://127.0.0.1:{cluster.port}  (API docs: /docs)")
        _wait("the controller", lambda: api.ready(), 60, cluster)
        _wait("3 nodes", lambda: len(api.nodes()) == 3, 60, cluster)
        print(f"    nodes       {', '.join(n['name'] for n in api.nodes())}")

        spec = demo_job_spec(steps)
        (workdir / "demo-job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        job = api.submit(spec)
        job_id = job["id"]
        _say(f"submitted job {job_id} (2..3 nodes; spec in {workdir / 'demo-job.yaml'})")
        victim: str | None = None
        last_event: str | None = None
        last_line = ""
        while True:
            job = api.job(job_id)
            for e in api.events(job_id, after=last_event):
                print("    " + event_line(e), flush=True)
                last_event = e["id"]
            line = progress_line(job)
            if line != last_line:
                print("    " + line, flush=True)
                last_line = line
            ckpt = (job.get("checkpoint") or {}).get("step")
            if victim is None and job["world_size"]["current"] == 3 and ckpt is not None and ckpt >= 20:
                victim = job["nodes"][-1]
                proc = cluster.agents[victim]
                _say(f"killing the agent of {victim} (pid {proc.pid}) with SIGKILL: the node is gone")
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            if job["state"] in ("succeeded", "failed", "cancelled"):
                break
            if time.monotonic() - started > 600:
                raise RuntimeError("the demo job did not finish within 10 minutes")
            time.sleep(1.0)

        _say(f"job {job['state']}")
        print(job_text(job))
        ckpt_dir = workdir / "checkpoints" / job_id
        _say(f"checkpoints are in {ckpt_dir}")
        for name, size in snapshot_sizes(ckpt_dir):
            print(f"    {name:<20} {size:>10,} bytes")
        print(f"    job logs: {workdir / 'agents'}/<node>/jobs/{job_id}/")
        sizes = [c["world_size"] for c in job["world_size"]["history"]]
        ok = job["state"] == "succeeded" and victim is not None and 3 in sizes and sizes[-1] == 2
        _say(
            f"demo {'OK' if ok else 'FAILED'} in {time.monotonic() - started:.0f}s: world size history "
            f"{' -> '.join(map(str, sizes))}, restarts {job['restarts']}"
        )
        if keep:
            _say("cluster left running; Ctrl-C stops it")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0 if ok else 1
    except (RuntimeError, ApiError) as exc:
        print(f"etrain demo: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("stopping the cluster")
        cluster.stop()
