"""Recovery benchmark: this project (etcd-v3 rendezvous) vs stock torchrun's c10d, same training script.

Every system runs ``elastic/testing/train_worker.py`` (the ElasticTrainer: same model, data, checkpoint
interval and resume logic) under stock torchrun, two agents of one worker each (``--nnodes=1:2``); only
the rendezvous backend (and, for live recovery, ``--recovery live``) differs. c10d runs with torch's
defaults and with ``last_call_timeout=1``. With live recovery (``recovery=live``) each agent runs a
node-local world and the workers keep their processes: survivors re-form in place, a restarted or new
worker joins at a step boundary.

1. Kills, per trial: SIGKILL of agent b's worker (its agent restarts it) -> time to the next completed
   step (restart systems: of the re-formed group; live: of the survivors); then SIGKILL of agent b's whole
   process tree (a node) -> the survivor's next completed step; then a replacement node (agent c) ->
   the first step recorded by c's worker, from c's start. For each failure: lost steps = steps committed
   before the kill that are done again (restart: the resumed group re-does them from its snapshot; live:
   a later generation records their step numbers again), and whether agent a's (the survivor's) worker
   PID changed.
2. Goodput: a bounded run with one failure every ``--interval`` seconds (alternately a worker SIGKILL and a
   node SIGKILL followed at once by a replacement node); goodput = step progress over the run / (the
   fault-free step rate measured in the same run before the first failure x the run's duration). Also:
   each replacement node's first step from its agent's start, and the survivor's worker PID changes.

    python bench/recovery_bench.py [--trials 3] [--goodput-duration 120] [--systems etcd-v3-live,etcd-v3-warm]

A sharded model: ``--systems hsdp-live,hsdp-restart,hsdp-c10d`` runs the same with FSDP2 HSDP, two workers per
agent (a node is one replica of two shards): live recovery with ``parallelize=`` against restart mode (a DCP
reshard at each world) on etcd-v3 and on stock torchrun's c10d.
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

from elastic.contract.env import LOCAL_SNAPSHOT_DIR  # noqa: E402
from elastic.prefork import worker_tree  # noqa: E402
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
    worker_args: tuple[str, ...] = ()  # extra train_worker.py arguments (live recovery: --recovery live)
    nproc: int = 1  # workers per agent (HSDP: a node's workers are one replica's shards)

    def endpoint(self, etcd: LocalEtcdCluster) -> str:
        return etcd.endpoints if self.backend == "etcd-v3" else f"127.0.0.1:{free_port()}"


# fmt: off
SYSTEMS = {
    s.key: s
    for s in (
        System("etcd-v3-live", "this project, live recovery (survivors keep their processes)", "etcd-v3",
               {"last_call_timeout": 1, "recovery": "live"}, True, worker_args=("--recovery", "live")),
        System("etcd-v3-local", "this project (etcd-v3 + warm starts + node-local snapshot every step)", "etcd-v3",
               {"last_call_timeout": 1}, True, local_every=1),
        System("etcd-v3-warm", "this project (etcd-v3 + warm starts)", "etcd-v3", {"last_call_timeout": 1}, True),
        System("etcd-v3", "this project, cold starts (warm_start=false)", "etcd-v3", {"last_call_timeout": 1}),
        System("c10d", "torchrun c10d (defaults)", "c10d", {}),
        System("c10d-tuned", "torchrun c10d (last_call_timeout=1)", "c10d", {"last_call_timeout": 1}),
    )
}
# A sharded model (FSDP2 HSDP: a node a replica of 2 shards), 2 workers per agent; chosen with --systems.
_HSDP = ("--fsdp", "--hsdp-shard", "2")
HSDP_SYSTEMS = {
    s.key: s
    for s in (
        System("hsdp-live", "HSDP, live recovery (parallelize=: shards kept in place)", "etcd-v3",
               {"last_call_timeout": 1, "recovery": "live"}, True,
               worker_args=("--recovery", "live", "--fsdp", "--parallelize"), nproc=2),
        System("hsdp-restart", "HSDP, etcd-v3 restart + warm starts (DCP reshard)", "etcd-v3",
               {"last_call_timeout": 1}, True, worker_args=_HSDP, nproc=2),
        System("hsdp-c10d", "HSDP, torchrun c10d (last_call_timeout=1)", "c10d", {"last_call_timeout": 1},
               worker_args=_HSDP, nproc=2),
    )
}
# Faster failure detection: a node's liveness lease of 1 s instead of the default 2 s.
FAST_DETECT = System(
    "etcd-v3-ttl1", "this project (etcd-v3 + warm starts, node_ttl=1)", "etcd-v3",
    {"last_call_timeout": 1, "node_ttl": 1}, True,
)
# fmt: on


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
        args = [
            "--checkpoint-url",
            str(self.dir / "ck"),
            "--record",
            str(self.rec),
            "--epochs",
            "100000",
            "--samples",
            str(w.samples),
            "--batch",
            str(w.batch),
            "--lr-rule",
            "fixed-global-batch",
            "--base-world",
            "2",
            "--save-every",
            str(w.save_every),
            "--step-sleep",
            str(w.step_sleep),
            "--dropout",
            "0",
            "--local-every",
            str(self.system.local_every),
            *self.system.worker_args,
        ]
        cmd = torchrun_command(
            backend=self.system.backend,
            endpoint=self.endpoint,
            run_id=self.run_id,
            nnodes="1:2",
            nproc=self.system.nproc,
            rdzv_conf=self.system.conf,
            max_restarts=100,
            script=WORKER,
            script_args=args,
            prefork=self.system.prefork,
        )
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

    def recorded_pids(self) -> set[int]:
        """The pids of the workers that recorded a step (the files are ``rank<R>.<pid>.jsonl``)."""
        return {int(f.name.split(".")[1]) for f in self.rec.glob("rank*.*.jsonl")}

    def worker_of(self, agent: TorchrunAgent) -> frozenset[int]:
        """The pids of ``agent``'s training workers now (those of its processes that recorded a step)."""
        return frozenset(agent_pids(agent) & self.recorded_pids())

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        shutil.rmtree(self.shm, ignore_errors=True)

    def fail(self, what: str) -> RuntimeError:
        logs = "\n".join(f"--- {a.log_path.name}\n{a.log()[-1500:]}" for a in self.agents)
        return RuntimeError(f"{self.system.label}: {what}; see {self.dir}\n{logs}")


def agent_pids(agent: TorchrunAgent) -> set[int]:
    """The pids of ``agent``'s process tree (prefork clients and their forked workers included)."""
    if agent.process is None or agent.process.poll() is not None:
        return set()
    return {pid for pid, _ in worker_tree(agent.pid)}


def live_lost_steps(records: list[dict[str, Any]], killed_at: float) -> float:
    """Live recovery: the steps committed before ``killed_at`` whose step number a later generation than
    the killed one records again (a late record, of a step committed but recorded after the re-form, is
    not a re-do). 0 when no step is ever done twice."""
    before = [r for r in records if r["t"] <= killed_at]
    killed = max(before, key=lambda r: r["t"])["gen"]
    committed = {r["step"] for r in before}
    later = [r for r in records if r.get("gen") is not None and r["gen"] > killed and not r.get("late")]
    again = {r["step"] for r in later if r["step"] in committed}
    return float(len(again))


def recovery(
    job: Job, killed_at: float, world: int | None, timeout: float = 240, interrupted: bool = True
) -> dict[str, float]:
    """Time from ``killed_at`` to the next step completed by the re-formed group (at ``world``), and the
    steps that the killed group had committed and the resumed one re-does (live: see
    :func:`live_lost_steps`; taken again at the end of a trial, when every later generation is in).
    ``interrupted=False``: the killed worker was not training yet (a replacement not yet in the group), so the
    group goes on: the time to its next step, whichever group records it."""
    before_kill = [r for r in job.records() if r["t"] <= killed_at]
    if not before_kill:
        raise job.fail("no step before the kill")
    killed = max(before_kill, key=lambda r: r["t"])["attempt"]

    def after() -> list[dict[str, Any]]:
        return [
            r
            for r in job.records()
            if r["t"] > killed_at
            and (r["attempt"] != killed or not interrupted)
            and (world is None or r["world"] == world)
        ]

    if not wait_until(lambda: bool(after()), timeout, interval=0.02):
        raise job.fail(f"no step completed within {timeout}s of the kill")
    records = job.records()
    first = min(after(), key=lambda r: r["t"])
    if not interrupted:  # nothing was re-formed: nothing is done again
        return {"next_step_s": first["t"] - killed_at, "lost_steps": 0.0}
    if first.get("gen") is not None:  # live: no restart from a snapshot
        return {"next_step_s": first["t"] - killed_at, "lost_steps": live_lost_steps(records, killed_at)}
    before = max(r["step"] for r in records if r["attempt"] == killed)
    resumed_from = min(r["step"] for r in records if r["attempt"] == first["attempt"]) - 1
    return {"next_step_s": first["t"] - killed_at, "lost_steps": float(max(0, before - resumed_from))}


def _process_started(ticks: int) -> float:
    """The wall-clock time of a process's start, from its start time in clock ticks after boot."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def join(job: Job, name: str, timeout: float) -> tuple[TorchrunAgent, dict[str, float] | None]:
    """Start agent ``name`` (a replacement node) and time its worker's first recorded step: from the
    agent's start (``first_step_s``) and from that worker process's own start (``from_worker_start_s``: a
    fork of the zygote with warm starts; without the agent's and the zygote's start-up). None if no step
    within ``timeout``. Its workers are told by their pids: the agent's process tree is polled while waiting
    (a restart system may replace that worker before it records)."""
    started = time.time()
    agent = job.start_agent(name)
    seen: dict[int, int] = {}  # pid -> start time in clock ticks
    first: list[dict[str, Any]] = []

    def joined() -> bool:
        if agent.process is not None and agent.process.poll() is None:
            seen.update(worker_tree(agent.pid))
        mine = [
            r for pid in seen for f in job.rec.glob(f"rank*.{pid}.jsonl") for r in read_jsonl(f) if r["t"] > started
        ]
        if mine:
            first.append(min(mine, key=lambda r: r["t"]))
        return bool(mine)

    if not wait_until(joined, timeout, interval=0.1):
        return agent, None
    rec = first[-1]
    return agent, {
        "first_step_s": rec["t"] - started,
        "from_worker_start_s": rec["t"] - _process_started(seen[rec["pid"]]),
    }


def kill_trial(
    system: System, etcd: LocalEtcdCluster, workdir: Path, workload: Workload, rng: random.Random
) -> dict[str, dict[str, float]]:
    job = Job(system, etcd, workdir, workload)
    node = system.nproc  # a node's workers: the world is 2 nodes, then 1
    phase = workload.save_every * workload.step_sleep  # a random point of the checkpoint cycle
    try:
        a = job.start_agent("a")
        time.sleep(1.0)  # with c10d the first agent hosts the store: b is the one killed
        b = job.start_agent("b")
        if not wait_until(lambda: job.steps_at_world(2 * node) >= 20, 180):
            raise job.fail("a world of 2 nodes never formed")
        time.sleep(rng.uniform(0, phase))
        survivor = job.worker_of(a)
        if not survivor:
            raise job.fail("agent a's worker not found among the processes that recorded steps")
        worker_killed = b.kill_workers()
        worker = recovery(job, worker_killed, world=None)
        worker["survivor_pid_changed"] = float(job.worker_of(a) != survivor)
        resumed = time.time()
        if not wait_until(lambda: job.steps_at_world(2 * node, after=resumed) >= 15, 180):
            raise job.fail("the world of 2 never came back after the worker kill")
        time.sleep(rng.uniform(0, phase))
        survivor = job.worker_of(a)
        node_killed = b.kill_tree()
        lost_node = recovery(job, node_killed, world=node)
        lost_node["survivor_pid_changed"] = float(job.worker_of(a) != survivor)
        alone = time.time()  # a replacement node, once the survivor trains alone
        if not wait_until(lambda: job.steps_at_world(node, after=alone) >= 10, 180):
            raise job.fail("the survivor did not go on alone after the node kill")
        survivor = job.worker_of(a)
        _, joined = join(job, "c", 180)
        if joined is None:
            raise job.fail("the replacement node's worker recorded no step within 180s")
        joined_at = time.time()
        if not wait_until(lambda: job.steps_at_world(2 * node, after=joined_at) >= 3, 60):
            raise job.fail("no world of 2 after the replacement node joined")
        replacement = {**joined, "survivor_pid_changed": float(job.worker_of(a) != survivor)}
        if system.conf.get("recovery") == "live":  # every later generation is in: re-done steps, if any
            records = job.records()
            worker["lost_steps"] = live_lost_steps(records, worker_killed)
            lost_node["lost_steps"] = live_lost_steps(records, node_killed)
        return {"worker_kill": worker, "node_kill": lost_node, "join": replacement}
    finally:
        job.stop()


def bench_kills(
    systems: list[System], trials: int, etcd: LocalEtcdCluster, workdir: Path, workload: Workload, seed: int = 0
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    samples: dict[str, list[dict[str, dict[str, float]]]] = {s.key: [] for s in systems}
    for i in range(trials):  # interleaved: a noisy minute affects every system alike
        for s in systems:
            samples[s.key].append(kill_trial(s, etcd, workdir, workload, rng))
            t = samples[s.key][-1]
            w, n, j = t["worker_kill"], t["node_kill"], t["join"]
            print(
                f"kills {s.label:38s} trial {i + 1}: worker kill -> next step {w['next_step_s']:.2f}s"
                f" (lost {w['lost_steps']:.0f}, survivor PID changed {w['survivor_pid_changed']:.0f}),"
                f" node kill -> survivor's next step {n['next_step_s']:.2f}s (lost {n['lost_steps']:.0f},"
                f" survivor PID changed {n['survivor_pid_changed']:.0f}), replacement node -> its first step"
                f" {j['first_step_s']:.2f}s ({j['from_worker_start_s']:.2f}s from its worker's start;"
                f" survivor PID changed {j['survivor_pid_changed']:.0f})",
                flush=True,
            )
    rows = []
    for s in systems:
        row: dict[str, Any] = {"system": s.label, "key": s.key, "save_every_steps": workload.save_every}
        for kind in ("worker_kill", "node_kill"):
            for metric in ("next_step_s", "lost_steps", "survivor_pid_changed"):
                row[f"{kind}_{metric}"] = summarize([t[kind][metric] for t in samples[s.key]])
        for metric in ("first_step_s", "from_worker_start_s", "survivor_pid_changed"):
            row[f"join_{metric}"] = summarize([t["join"][metric] for t in samples[s.key]])
        rows.append(row)
    return rows


def goodput_trial(
    system: System, etcd: LocalEtcdCluster, workdir: Path, workload: Workload, duration: float, interval: float
) -> dict[str, Any]:
    job = Job(system, etcd, workdir, workload)
    try:
        a = job.start_agent("a")
        time.sleep(1.0)
        b = job.start_agent("b")
        if not wait_until(lambda: job.steps_at_world(2 * system.nproc) >= 5, 180):
            raise job.fail("a world of 2 nodes never formed")
        t0 = time.time()
        faults: list[dict[str, Any]] = []
        survivor: list[frozenset[int]] = []  # agent a's worker before each failure, and at the end
        k = 1
        while t0 + k * interval <= t0 + duration - interval / 2:
            time.sleep(max(0.0, t0 + k * interval - time.time()))
            survivor.append(job.worker_of(a))
            fault: dict[str, Any] = {"victim_training": bool(job.worker_of(b))}  # its worker had recorded steps
            if k % 2 == 1:
                killed_at, kind = b.kill_workers(), "worker_kill"
            else:
                killed_at, kind = b.kill_tree(), "node_kill"
                # the node comes back (a replacement); its worker's first step, timed until just before the
                # next failure (None if it has not stepped by then)
                b, joined = join(job, f"b{k}", max(1.0, t0 + (k + 1) * interval - time.time() - 0.5))
                fault["join_first_step_s"] = joined["first_step_s"] if joined else None
                fault["join_from_worker_start_s"] = joined["from_worker_start_s"] if joined else None
            faults.append({"kind": kind, "at_s": killed_at - t0, **fault})
            k += 1
        first_fault = t0 + interval
        time.sleep(max(0.0, t0 + duration - time.time()))
        end = time.time()
        survivor.append(job.worker_of(a))
        records = job.records()
        for i, f in enumerate(faults):
            f.update(recovery(job, t0 + f["at_s"], world=None, timeout=1, interrupted=f["victim_training"]))
            f["survivor_pid_changed"] = survivor[i] != survivor[i + 1]  # by the next failure (or the end)
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
            "survivor_pid_changes": sum(1 for f in faults if f["survivor_pid_changed"]),
        }
    finally:
        job.stop()


def bench_goodput(
    systems: list[System],
    trials: int,
    etcd: LocalEtcdCluster,
    workdir: Path,
    workload: Workload,
    duration: float,
    interval: float,
) -> list[dict[str, Any]]:
    results: dict[str, list[dict[str, Any]]] = {s.key: [] for s in systems}
    for i in range(trials):
        for s in systems:
            r = goodput_trial(s, etcd, workdir, workload, duration, interval)
            results[s.key].append(r)
            steps = ", ".join(
                f"{f['next_step_s']:.2f}s" + ("" if f["victim_training"] else " (victim not training)")
                for f in r["faults"]
            )
            joins = ", ".join(
                "none" if f["join_first_step_s"] is None else f"{f['join_first_step_s']:.2f}s"
                for f in r["faults"]
                if "join_first_step_s" in f
            )
            print(
                f"goodput {s.label:38s} trial {i + 1}: {r['goodput'] * 100:.1f} % ({r['steps']} steps in "
                f"{r['duration_s']:.0f}s, fault-free {r['fault_free_steps_per_s']:.2f} steps/s, "
                f"{len(r['faults'])} failures: next step {steps}; replacement node's first step {joins or '-'};"
                f" survivor PID changes {r['survivor_pid_changes']})",
                flush=True,
            )
    rows = []
    for s in systems:
        joined = [f["join_first_step_s"] for r in results[s.key] for f in r["faults"] if f.get("join_first_step_s")]
        rows.append(
            {
                "system": s.label,
                "key": s.key,
                "duration_s": duration,
                "interval_s": interval,
                "goodput": summarize([r["goodput"] for r in results[s.key]]),
                "join_first_step_s": summarize(joined),
                "survivor_pid_changes": summarize([r["survivor_pid_changes"] for r in results[s.key]]),
                "trials": results[s.key],
            }
        )
    return rows


def print_summary(result: dict[str, Any]) -> None:
    """The figures side by side, one column per system: median / p95 over the trials."""

    def cell(stat: dict[str, Any] | None, unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
        if not stat or stat.get("median") is None:
            return "-"
        return f"{stat['median'] * scale:.{digits}f} / {stat['p95'] * scale:.{digits}f}{unit}"

    kills = {r["key"]: r for r in result.get("kills", [])}
    good = {r["key"]: r for r in result.get("goodput", [])}
    keys = list(dict.fromkeys([*kills, *good]))
    figures = [
        ("worker SIGKILL -> next step", kills, "worker_kill_next_step_s", " s", 1.0, 2),
        ("node SIGKILL -> survivor's next step", kills, "node_kill_next_step_s", " s", 1.0, 2),
        ("replacement node -> its first step", kills, "join_first_step_s", " s", 1.0, 2),
        ("  the same from its worker's start", kills, "join_from_worker_start_s", " s", 1.0, 2),
        ("lost steps per worker kill", kills, "worker_kill_lost_steps", "", 1.0, 1),
        ("lost steps per node kill", kills, "node_kill_lost_steps", "", 1.0, 1),
        ("survivor PID changed, worker kill", kills, "worker_kill_survivor_pid_changed", "", 1.0, 1),
        ("survivor PID changed, node kill", kills, "node_kill_survivor_pid_changed", "", 1.0, 1),
        ("survivor PID changed, node join", kills, "join_survivor_pid_changed", "", 1.0, 1),
        ("goodput, one failure per interval", good, "goodput", " %", 100.0, 1),
        ("goodput run: replacement -> first step", good, "join_first_step_s", " s", 1.0, 2),
        ("goodput run: survivor PID changes", good, "survivor_pid_changes", "", 1.0, 0),
    ]
    rows = [
        (title, [cell(part[k].get(key) if k in part else None, unit, scale, digits) for k in keys])
        for title, part, key, unit, scale, digits in figures
        if part
    ]
    width = max((len(t) for t, _ in rows), default=0)
    cols = [max([len(k), *(len(c[i]) for _, c in rows)]) for i, k in enumerate(keys)]
    print("\nmedian / p95 over the trials")
    for title, cells in [("", keys), *rows]:
        print(title.ljust(width) + " | " + " | ".join(c.ljust(w) for c, w in zip(cells, cols, strict=True)))


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
    parser.add_argument("--keep-workdir", action="store_true", help="keep the agents' logs and records")
    args = parser.parse_args()
    known = {**SYSTEMS, **HSDP_SYSTEMS, FAST_DETECT.key: FAST_DETECT}
    unknown = [k for k in args.systems.split(",") if k not in known]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(known)}")
    systems = [known[k] for k in args.systems.split(",")]
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
        if args.keep_workdir:
            print(f"work dir (agent logs, records): {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print_summary(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
