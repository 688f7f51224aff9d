"""The controller at scale: reconcile pass time, etcd traffic per pass, API latency, with N nodes and J jobs.

Starts a real etcd (``--etcd-members``, 1 by default: on a small machine three members on loopback take
the CPU the controller is measured with), the real controller app in this process (``create_app``: the
reconcile loop and the REST API served by uvicorn on 127.0.0.1, authentication on), and simulated node
agents in another process (``_scale_agents.py``: they register on their own leases, keep them alive,
report their workers and write the workers' progress, but run no torchrun). Before the controller starts,
``--history`` finished jobs are stored (as the API and the leader leave them: jobs kept for the
retention period). Then ``--jobs`` jobs (2..4 nodes each) are submitted through the API and run; jobs
that finish are replaced by new submissions, so about ``--jobs`` are active and the history grows.

Phases: *schedule* (submit, until the jobs run), *steady* (``--duration`` s: progress from every job about
once a second, a node dying every ``--churn-every`` s, ``GET /v1/jobs/{id}`` load on ``--connections``
connections from another process and a ``/metrics`` scrape every second), *quiet* (5 s: no progress,
no churn; the passes that then find nothing new are the idle ones).

Every reconcile pass is timed, with the etcd requests it made and the payload bytes (keys and values) it
read and wrote, counted by a pass-through ``EtcdClient`` around the controller's client (only the
reconcile thread's requests, during the pass). A pass *after a change* read a newer revision than the
pass before; an *idle* pass did not.

    python bench/controller_scale_bench.py [--nodes 1000] [--jobs 200] [--duration 30] [--out PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import uvicorn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))


from elastic.etcd import create_client  # noqa: E402
from elastic.testing.counting_etcd import CountingEtcdClient  # noqa: E402
from elastic.testing.etcd_server import LocalEtcdCluster, free_port  # noqa: E402
from service.api.app import create_app  # noqa: E402
from service.controller.loop import Controller  # noqa: E402
from service.core.config import EtcdOptions, Role, Settings, TokenEntry  # noqa: E402
from service.core.models import JobRecord, JobSpec, JobStatus  # noqa: E402
from service.core.states import JobState  # noqa: E402
from service.core.store import ServiceStore, new_event  # noqa: E402

TOKEN = "bench-admin-token-0123456789abcdef"
PREFIX = "/bench-scale"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _summary(values: list[float], scale: float = 1.0) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": _pct(values, 0.5) * scale,
        "p99": _pct(values, 0.99) * scale,  # type: ignore[operator]
        "max": max(values) * scale,
        "mean": statistics.fmean(values) * scale,
    }


def _applying() -> bool:
    """A thread the controller hands a plan's transactions to: its requests belong to the pass."""
    return threading.current_thread().name.startswith("etrain-apply")


class PassRecorder:
    """Wraps ``Controller.tick``: times each pass and counts its etcd traffic."""

    def __init__(self, controller: Controller, client: CountingEtcdClient, profile: bool = False) -> None:
        self.profile = cProfile.Profile() if profile else None
        self.passes: list[dict[str, Any]] = []
        self.failures: list[str] = []  # passes that raised (the loop logs them and retries)
        self.phase = "start"
        self._last_revision = 0
        inner = controller.tick

        def tick(now: datetime | None = None) -> int | None:
            with client.record(also=_applying) as tally:
                started = time.perf_counter()
                try:
                    if self.profile is not None and self.phase == "steady":
                        revision = self.profile.runcall(inner, now)
                    else:
                        revision = inner(now)
                except Exception as exc:
                    self.failures.append(f"{self.phase}: {str(exc)[:200]}")
                    raise
                spent = time.perf_counter() - started
            if revision is not None:
                self.passes.append(
                    {
                        "phase": self.phase,
                        "s": spent,
                        "revision": revision,
                        "changed": revision > self._last_revision,
                        "requests": tally.requests,
                        "bytes_read": tally.bytes_read,
                        "bytes_written": tally.bytes_written,
                    }
                )
                self._last_revision = revision
            return revision

        controller.tick = tick  # type: ignore[method-assign]

    def report(self, phase: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind in ("changed", "idle"):
            sel = [
                p for p in self.passes if (phase is None or p["phase"] == phase) and p["changed"] == (kind == "changed")
            ]
            out[kind] = {
                "pass_ms": _summary([p["s"] for p in sel], 1e3),
                "requests": _summary([float(p["requests"]) for p in sel]),
                "kb_read": _summary([p["bytes_read"] for p in sel], 1e-3),
                "kb_written": _summary([p["bytes_written"] for p in sel], 1e-3),
            }
        return out


#: what a realistic job's spec carries besides its shape (issue 48's "ordinary jobs of about 1 KB, a 5-line spec")
_HISTORY_ENV = {
    "WANDB_PROJECT": "llm-sweep",
    "WANDB_API_KEY": "x" * 40,
    "HF_HOME": "/lustre/cache/hf",
    "NCCL_DEBUG": "WARN",
    "OMP_NUM_THREADS": "8",
    "DATA_DIR": "/lustre/datasets/owt/v3",
}
_HISTORY_ARGS = ["--config", "configs/gpt2-small.yaml", "--lr", "3e-4", "--batch-size", "32", "--max-steps", "20000"]


def store_history(store: ServiceStore, count: int) -> None:
    """``count`` finished jobs of a realistic size (about 1 KB of spec), as the API and the leader leave them (record,
    terminal status, events), several at a time."""
    now = datetime.now(timezone.utc)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _store_one(store, i, now), range(count)))


def _store_one(store: ServiceStore, i: int, now: datetime) -> None:
    spec = JobSpec(
        name=f"old-{i}",
        entrypoint="train.py",
        min_nodes=2,
        max_nodes=4,
        env=_HISTORY_ENV,
        args=_HISTORY_ARGS,
        checkpoint_url=f"s3://ckpt/sweep/old-{i}",
    )
    created = now - timedelta(hours=1, seconds=i)
    record = JobRecord(id=f"old-{i}-{i:08x}", spec=spec, created_at=created, submitted_by="bench")
    status = JobStatus(
        state=JobState.SUCCEEDED,
        message="finished at step 100",
        generation=1,
        step=100,
        created_at=created,
        updated_at=now,
        started_at=created,
        finished_at=now,
    )
    store.create_job(record, status, new_event("submitted", "submitted by bench", created))


def _spec(i: int) -> dict[str, Any]:
    return {"name": f"scale-{i}", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 4}


def _wait(predicate: Any, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise TimeoutError(what)
        time.sleep(0.5)
    return time.monotonic() - began


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    with LocalEtcdCluster(args.etcd_members, workdir=workdir / "etcd") as etcd:
        setup = create_client(etcd.config())
        store_history(ServiceStore(setup, PREFIX), args.history)
        agents = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_scale_agents.py"),
                "agents",
                "--etcd",
                etcd.endpoints,
                "--prefix",
                PREFIX,
                "--nodes",
                str(args.nodes),
                "--churn-every",
                str(args.churn_every),
                "--token",
                TOKEN,
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert agents.stdin is not None and agents.stdout is not None
        line = agents.stdout.readline()
        print(f"{args.nodes} simulated nodes registered ({line.strip()} s)", flush=True)

        client = CountingEtcdClient(create_client(etcd.config()))
        settings = Settings(
            etcd=EtcdOptions(etcd.endpoints),
            prefix=PREFIX,
            host="127.0.0.1",
            tokens=(TokenEntry(TOKEN, Role.ADMIN, "bench"),),
        )
        app = create_app(settings, client=client)
        recorder = PassRecorder(app.state.controller, client, profile=args.profile is not None)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        _wait(lambda: server.started, 30, "uvicorn did not start")
        try:
            recorder.phase = "schedule"
            submitted: list[str] = []
            began = time.monotonic()
            for i in range(args.jobs):
                r = http.post("/v1/jobs", json=_spec(i))
                r.raise_for_status()
                submitted.append(r.json()["id"])
            submit_s = time.monotonic() - began
            list_ms = []
            for _ in range(5):
                t0 = time.monotonic()
                http.get("/v1/jobs", params={"limit": 200}).raise_for_status()
                list_ms.append((time.monotonic() - t0) * 1e3)
            agents.stdin.write(f"api {url}\nsteady\n")
            agents.stdin.flush()

            def count(state: str) -> int:
                return len(http.get("/v1/jobs", params={"state": state, "limit": 1000}).json()["jobs"])

            schedule_s = _wait(lambda: count("running") >= args.jobs * 0.95, 300, "jobs did not start") + submit_s
            print(f"{args.jobs} jobs submitted in {submit_s:.1f} s, 95% running after {schedule_s:.1f} s", flush=True)

            recorder.phase = "steady"
            ids_file = workdir / "ids.json"
            ids_file.write_text(json.dumps(submitted))
            api_out = workdir / "api.json"
            load = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "_scale_agents.py"),
                    "api",
                    "--port",
                    str(port),
                    "--token",
                    TOKEN,
                    "--job-ids",
                    str(ids_file),
                    "--connections",
                    str(args.connections),
                    "--duration",
                    str(args.duration),
                    "--out",
                    str(api_out),
                ],
                env=env,
            )
            load.wait(timeout=args.duration + 60)  # the agents replace finished jobs by new ones meanwhile
            recorder.phase = "quiet"
            agents.stdin.write("quiet\n")
            agents.stdin.flush()
            time.sleep(args.quiet)
            api = json.loads(api_out.read_text())
            states = {state.value: count(state.value) for state in JobState}
        finally:
            server.should_exit = True
            time.sleep(1)
            agents.stdin.write("stop\n")
            agents.stdin.flush()
            tail = agents.stdout.read().split()
            replaced = int(tail[tail.index("replaced") + 1]) if "replaced" in tail else -1
            agents.wait(timeout=30)
            setup.close()
    if recorder.profile is not None:
        recorder.profile.dump_stats(args.profile)
    return {
        "nodes": args.nodes,
        "jobs": args.jobs,
        "history": args.history,
        "etcd_members": args.etcd_members,
        "duration_s": args.duration,
        "connections": args.connections,
        "churn_every_s": args.churn_every,
        "submit_s": submit_s,
        "schedule_s": schedule_s,
        "jobs_replaced": replaced,
        "job_states_at_end": states,
        "passes": {phase: recorder.report(phase) for phase in ("schedule", "steady", "quiet")},
        "passes_all": recorder.report(),
        "failed_passes": len(recorder.failures),
        "failed_pass_examples": recorder.failures[:3],
        "api_status_ms": _summary(api["status_s"], 1e3),
        "metrics_ms": _summary(api["metrics_s"], 1e3),
        "api_non_200": len(api["non_200"]),
        "list_jobs_ms": _summary(list_ms, 1.0),
    }


def _fmt(s: dict[str, Any], unit: str = "") -> str:
    if not s.get("n"):
        return "-"
    return f"p50 {s['p50']:.1f}{unit} p99 {s['p99']:.1f}{unit} max {s['max']:.1f}{unit} (n={s['n']})"


def print_result(r: dict[str, Any]) -> None:
    print(
        f"\ncontroller at scale: {r['nodes']} nodes, {r['jobs']} active jobs, {r['history']} finished jobs "
        f"stored before, etcd members {r['etcd_members']}, steady {r['duration_s']:.0f} s"
    )
    for phase, rep in r["passes"].items():
        for kind in ("changed", "idle"):
            x = rep[kind]
            if not x["pass_ms"].get("n"):
                continue
            print(f"  {phase:8s} {kind:7s} pass {_fmt(x['pass_ms'], ' ms')}")
            print(
                f"  {'':8s} {'':7s} etcd requests p50 {x['requests']['p50']:.0f} max {x['requests']['max']:.0f};"
                f" read p50 {x['kb_read']['p50']:.1f} KB max {x['kb_read']['max']:.1f} KB;"
                f" written p50 {x['kb_written']['p50']:.1f} KB"
            )
    if r["failed_passes"]:
        print(f"  FAILED passes: {r['failed_passes']}, e.g. {r['failed_pass_examples'][0]}")
    print(f"  GET /v1/jobs/{{id}} {_fmt(r['api_status_ms'], ' ms')}; non-200: {r['api_non_200']}")
    print(f"  GET /metrics     {_fmt(r['metrics_ms'], ' ms')}")
    print(f"  GET /v1/jobs (first 200 of every job) {_fmt(r['list_jobs_ms'], ' ms')}")
    print(
        f"  submit {r['jobs']} jobs {r['submit_s']:.1f} s; 95% running after {r['schedule_s']:.1f} s;"
        f" {r['jobs_replaced']} finished jobs replaced during the steady phase"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--history", type=int, default=1000, help="finished jobs stored before the start")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the steady phase")
    parser.add_argument("--quiet", type=float, default=5.0, help="seconds of the quiet phase")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--churn-every", type=float, default=5.0)
    parser.add_argument("--etcd-members", type=int, default=1)
    parser.add_argument("--profile", type=Path, help="write cProfile stats of the steady phase's passes here")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "controller_scale.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    try:
        result = run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    print_result(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
