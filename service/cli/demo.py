"""``etrain demo``: a whole cluster on one machine, a job, a node killed mid-run, the job recovering.

Starts a local etcd, the controller and three node agents (as separate processes, exactly as in
production but on loopback), submits ``examples/demo_job.py`` on 2..3 nodes, SIGKILLs one agent once
the job has committed a checkpoint at world size 3, follows the job as it re-forms on two nodes and
finishes, then prints the world-size history and where the checkpoints are. Everything lives under
``--workdir`` (default ``.demo``).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from elastic.testing.wait import wait_for
from service.cli.render import event_line, job_text, progress_line
from service.client import ApiError
from service.core.states import TERMINAL_STATES
from service.testing.cluster import LocalServiceCluster

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


def _wait(what: str, check: Callable[[], bool], timeout: float, cluster: LocalServiceCluster) -> None:
    try:
        wait_for(lambda: cluster.check_alive() and check(), timeout, 0.5, what=what, retry_on=(ApiError,))
    except AssertionError:
        raise RuntimeError(f"timed out waiting for {what}: see {cluster.logs}") from None


def _say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run_demo(workdir: Path, keep: bool = False, steps: int = 150) -> int:
    """Run the demo (see the module docstring); 0 when the job recovered and succeeded."""
    started = time.monotonic()
    for sub in ("etcd", "logs", "agents", "checkpoints"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    cluster: LocalServiceCluster | None = None
    try:
        _say(f"starting etcd, the controller and 3 node agents (logs in {workdir / 'logs'})")
        cluster = LocalServiceCluster(workdir, lease_ttl=3.0)
        api = cluster.start_controller()
        for node in _NODES:
            cluster.start_agent(node, nproc_per_node=1)
        print(f"    etcd        {cluster.etcd.endpoints}")
        print(f"    controller  {cluster.url}  (API docs: /docs)")
        print(f"    dashboard   {cluster.url}/ui/  (open it while the demo runs)")
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
                _say(f"killing the agent of {victim} (pid {cluster.agents[victim].pid}) with SIGKILL: the node is gone")
                cluster.kill_agent(victim)
            if job["state"] in TERMINAL_STATES:
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
        if cluster is not None:
            _say("stopping the cluster")
            cluster.stop()
