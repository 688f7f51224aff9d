"""Recovery benchmark: this project (etcd-v3 rendezvous) vs stock torchrun's c10d, same training script.

Both systems run ``elastic/testing/train_worker.py`` (the ElasticTrainer: same model, data, checkpoint
interval and resume logic) under stock torchrun, two agents of one worker each (``--nnodes=1:2``); only
the rendezvous backend differs. c10d runs with torch's defaults and with ``last_call_timeout=1``.

1. Kills, per trial: SIGKILL of agent b's worker (the agent restarts its group) -> time to the next
   completed step; then SIGKILL of agent b's whole process tree (a node) -> the survivor's next completed
   step. For each failure: lost steps = steps committed before the kill that the resumed run re-does.
2. Goodput: a bounded run with one failure every ``--interval`` seconds (alternately a worker SIGKILL and a
   node SIGKILL followed at once by a replacement node); goodput = step progress over the run / (the
   fault-free step rate measured in the same run before the first failure x the run's duration).

    python bench/recovery_bench.py [--trials 3] [--goodput-duration 120] [--systems etcd-v3,c10d,c10d-tuned]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import summarize  # noqa: E402

from elastic.env import LOCAL_SNAPSHOT_DIR  # noqa: E402
from elastic.testing.etcd_server import LocalEtcdCluster, free_port  # noqa: E402
from elastic.testing.torchrun import TorchrunAgent, read_jsonl, torchrun_command  # noqa: E402
from elastic.testing.wait import wait_until  # noqa: E402

WORKER = str(REPO / "elastic" / "testing" / "train_worker.py")


@dataclass(frozen=True)
class System:
    key: str
    label: str
    backend: str
    conf: dict[str, object] = field(default_factory=dict)
    prefork: bool = False
    local_every: int = 0  # node-local snapshot every N steps (elastic/checkpoint/tiers.py); 0: off

    def endpoint(self, etcd: LocalEtcdCluster) -> str:
        return etcd.endpoints if self.backend == "etcd-v3" else f"127.0.0.1:{free_port()}"


SYSTEMS = {
    s.key: s
    for s in (
        System("etcd-v3-local", "this project (etcd-v3 + warm starts + node-local snapshot every step)", "etcd-v3",
               {"last_call_timeout": 1}, True, local_every=1),
        System("etcd-v3-warm", "this project (etcd-v3 + warm starts)", "etcd-v3", {"last_call_timeout": 1}, True),
        System("etcd-v3", "this project, cold starts (warm_start=false)", "etcd-v3", {"last_call_timeout": 1}),
        System("c10d", "torchrun c10d (defaults)", "c10d", {}),
        System("c10d-tuned", "torchrun c10d (last_call_timeout=1)", "c10d", {"last_call_timeout": 1}),
    )
}
# Faster failure detection: a node's liveness lease of 1 s instead of the default 2 s.
FAST_DETECT = System(
    "etcd-v3-ttl1", "this project (etcd-v3 + warm starts, node_ttl=1)", "etcd-v3",
    {"last_call_timeout": 1, "node_ttl": 1}, True,
)  # fmt: skip


@dataclass
class Workload:
    save_every: int = 5
    step_sleep: float = 0.1
    samples: int = 2048
    batch: int = 8


class Job:
    """One training job: two (or more, with replacements) torchrun agents of one worker each."""

    def __init__(self, system: System, etcd: LocalEtcdCluster, workdir: Path, workload: Workload) -> None:
        self.system = system
        self.endpoint = system.endpoint(etcd)
        self.run_id = f"{system.key}-{uuid.uuid4().hex[:8]}"
        self.dir = workdir / self.run_id
        self.rec = self.dir / "rec"
        self.rec.mkdir(parents=True)
        self.workload = workload
        self.agents: list[TorchrunAgent] = []
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.shm = shm / f"etrain-bench-{self.run_id}"

    def start_agent(self, name: str) -> TorchrunAgent:
        w = self.workload
        args = ["--checkpoint-url", str(self.dir / "ck"), "--record", str(self.rec), "--epochs", "100000",
                "--samples", str(w.samples), "--batch", str(w.batch), "--lr-rule", "fixed-global-batch",
                "--base-world", "2", "--save-every", str(w.save_every), "--step-sleep", str(w.step_sleep),
                "--dropout", "0", "--local-every", str(self.system.local_every)]  # fmt: skip
        cmd = torchrun_command(
            backend=self.system.backend, endpoint=self.endpoint, run_id=self.run_id, nnodes="1:2", nproc=1,
            rdzv_conf=self.system.conf, max_restarts=100, script=WORKER, script_args=args,
            prefork=self.system.prefork,
        )  # fmt: skip
        env = {"LOGLEVEL": "WARNING", LOCAL_SNAPSHOT_DIR: str(self.shm)}  # in memory, removed by stop()
        agent = TorchrunAgent(cmd, self.dir / f"{name}.log", env=env).start()
        self.agents.append(agent)
        return agent

    def records(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for f in self.rec.glob("rank*.jsonl"):
            out.extend(read_jsonl(f))
        return out

    def steps_at_world(self, world: int, after: float = 0.0) -> int:
        return sum(1 for r in self.records() if r["world"] == world and r["t"] > after and r["rank"] == 0)

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        shutil.rmtree(self.shm, ignore_errors=True)

    def fail(self, what: str) -> RuntimeError:
        logs = "\n".join(f"--- {a.log_path.name}\n{a.log()[-1500:]}" for a in self.agents)
        return RuntimeError(f"{self.system.label}: {what}; see {self.dir}\n{logs}")


def recovery(job: Job, killed_at: float, world: int | None, timeout: float = 240) -> dict[str, float]:
    """Time from ``killed_at`` to the next step completed by the re-formed group (at ``world``), and the
    steps that the killed group had committed and the resumed one re-does."""
    before_kill = [r for r in job.records() if r["t"] <= killed_at]
    if not before_kill:
        raise job.fail("no step before the kill")
    killed = max(before_kill, key=lambda r: r["t"])["attempt"]

    def after() -> list[dict[str, Any]]:
        return [
            r for r in job.records()
            if r["t"] > killed_at and r["attempt"] != killed and (world is None or r["world"] == world)
        ]  # fmt: skip

    if not wait_until(lambda: bool(after()), timeout, interval=0.02):
        raise job.fail(f"no step completed within {timeout}s of the kill")
    records = job.records()
    first = min(after(), key=lambda r: r["t"])
    before = max(r["step"] for r in records if r["attempt"] == killed)
    resumed_from = min(r["step"] for r in records if r["attempt"] == first["attempt"]) - 1
    return {"next_step_s": first["t"] - killed_at, "lost_steps": float(max(0, before - resumed_from))}


def kill_trial(system: System, etcd: LocalEtcdCluster, workdir: Path, workload: Workload,
               rng: random.Random) -> dict[str, dict[str, float]]:  # fmt: skip
    job = Job(system, etcd, workdir, workload)
    phase = workload.save_every * workload.step_sleep  # a random point of the checkpoint cycle
    try:
        job.start_agent("a")
        time.sleep(1.0)  # with c10d the first agent hosts the store: b is the one killed
        b = job.start_agent("b")
        if not wait_until(lambda: job.steps_at_world(2) >= 20, 180):
            raise job.fail("a world of 2 never formed")
        time.sleep(rng.uniform(0, phase))
        worker = recovery(job, b.kill_workers(), world=None)
        resumed = time.time()
        if not wait_until(lambda: job.steps_at_world(2, after=resumed) >= 15, 180):
            raise job.fail("the world of 2 never came back after the worker kill")
        time.sleep(rng.uniform(0, phase))
        node = recovery(job, b.kill_tree(), world=1)
        return {"worker_kill": worker, "node_kill": node}
    finally:
        job.stop()


def bench_kills(systems: list[System], trials: int, etcd: LocalEtcdCluster, workdir: Path, workload: Workload,
                seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    rng = random.Random(seed)
    samples: dict[str, list[dict[str, dict[str, float]]]] = {s.key: [] for s in systems}
    for i in range(trials):  # interleaved: a noisy minute affects every system alike
        for s in systems:
            samples[s.key].append(kill_trial(s, etcd, workdir, workload, rng))
            w, n = samples[s.key][-1]["worker_kill"], samples[s.key][-1]["node_kill"]
            print(f"kills {s.label:38s} trial {i + 1}: worker kill -> next step {w['next_step_s']:.2f}s"
                  f" (lost {w['lost_steps']:.0f}), node kill -> survivor's next step {n['next_step_s']:.2f}s"
                  f" (lost {n['lost_steps']:.0f})", flush=True)  # fmt: skip
    rows = []
    for s in systems:
        row: dict[str, Any] = {"system": s.label, "key": s.key, "save_every_steps": workload.save_every}
        for kind in ("worker_kill", "node_kill"):
            for metric in ("next_step_s", "lost_steps"):
                row[f"{kind}_{metric}"] = summarize([t[kind][metric] for t in samples[s.key]])
        rows.append(row)
    return rows


def goodput_trial(system: System, etcd: LocalEtcdCluster, workdir: Path, workload: Workload, duration: float,
                  interval: float) -> dict[str, Any]:  # fmt: skip
    job = Job(system, etcd, workdir, workload)
    try:
        job.start_agent("a")
        time.sleep(1.0)
        b = job.start_agent("b")
        if not wait_until(lambda: job.steps_at_world(2) >= 5, 180):
            raise job.fail("a world of 2 never formed")
        t0 = time.time()
        faults: list[dict[str, Any]] = []
        k = 1
        while t0 + k * interval <= t0 + duration - interval / 2:
            time.sleep(max(0.0, t0 + k * interval - time.time()))
            if k % 2 == 1:
                killed_at, kind = b.kill_workers(), "worker_kill"
            else:
                killed_at, kind = b.kill_tree(), "node_kill"
                b = job.start_agent(f"b{k}")  # the node comes back (a replacement)
            faults.append({"kind": kind, "at_s": killed_at - t0})
            k += 1
        first_fault = t0 + interval
        time.sleep(max(0.0, t0 + duration - time.time()))
        end = time.time()
        records = job.records()
        for f in faults:
            f.update(recovery(job, t0 + f["at_s"], world=None, timeout=1))
        progress_0 = max(r["step"] for r in records if r["t"] <= t0)
        progress_first = max(r["step"] for r in records if r["t"] <= first_fault)
        progress_end = max(r["step"] for r in records if r["t"] <= end)
        rate = (progress_first - progress_0) / (first_fault - t0)
        return {
            "duration_s": end - t0,
            "faults": faults,
            "fault_free_steps_per_s": rate,
            "steps": progress_end - progress_0,
            "goodput": (progress_end - progress_0) / (rate * (end - t0)),
        }
    finally:
        job.stop()


def bench_goodput(systems: list[System], trials: int, etcd: LocalEtcdCluster, workdir: Path, workload: Workload,
                  duration: float, interval: float) -> list[dict[str, Any]]:  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {s.key: [] for s in systems}
    for i in range(trials):
        for s in systems:
            r = goodput_trial(s, etcd, workdir, workload, duration, interval)
            results[s.key].append(r)
            print(f"goodput {s.label:38s} trial {i + 1}: {r['goodput'] * 100:.1f} % ({r['steps']} steps in "
                  f"{r['duration_s']:.0f}s, fault-free {r['fault_free_steps_per_s']:.2f} steps/s, "
                  f"{len(r['faults'])} failures)", flush=True)  # fmt: skip
    return [
        {
            "system": s.label,
            "key": s.key,
            "duration_s": duration,
            "interval_s": interval,
            "goodput": summarize([r["goodput"] for r in results[s.key]]),
            "trials": results[s.key],
        }
        for s in systems
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--goodput-trials", type=int, default=1)
    parser.add_argument("--goodput-duration", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between failures (goodput)")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint interval in steps")
    parser.add_argument("--step-sleep", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--skip-goodput", action="store_true")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "recovery.json")
    args = parser.parse_args()
    systems = [SYSTEMS[k] if k in SYSTEMS else FAST_DETECT for k in args.systems.split(",")]
    workload = Workload(save_every=args.save_every, step_sleep=args.step_sleep)
    workdir = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": vars(workload),
    }
    try:
        with LocalEtcdCluster(1, workdir=workdir / "etcd") as etcd:
            result["kills"] = bench_kills(systems, args.trials, etcd, workdir, workload)
            if not args.skip_goodput:
                result["goodput"] = bench_goodput(
                    systems, args.goodput_trials, etcd, workdir, workload, args.goodput_duration, args.interval
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
