"""Steady-state overhead of the elastic loop: step throughput under the ElasticTrainer (etcd-v3 rendezvous,
async verified snapshots) vs the same model in plain DDP under stock torchrun (--standalone) with the tutorial's
synchronous torch.save from rank 0, at the same checkpoint interval, interleaved rounds.

On CPU (default): the char transformer, 2 workers, gloo, a snapshot every 100 steps; goal: ratio >= 0.98.
Reports wall-clock steps/s and steps per CPU-second of rank 0 (the latter is robust to other load on the
machine). ``--with-local`` adds a third system per round: the elastic loop with a node-local snapshot every
step (elastic/checkpoint/tiers.py), to price it. ``--with-wait`` adds the elastic loop with
``when_writer_busy="wait"`` (a snapshot falling due while the previous one is written waits for it: the loop's
behaviour before deferral), to show what deferral buys.

``--with-live`` adds live recovery (``recovery="live"``: no DDP, the loop's own gradient all-reduce, overlapped
with the backward pass) beside the elastic loop with DDP; its goal: >= 0.97 of the elastic loop's (DDP's) rate, as
the median of the rounds' ratios (each round's live run against the same round's DDP run; printed with each round's
ratio, the spread, and against plain DDP too; at least 5 rounds by default).
The case where all-reduce matters on CPU: ``--model mlp --agents 2`` (an MLP of 4 x 1024^2, two torchrun agents
of one worker each; plain DDP then uses torch's c10d rendezvous on a local port, the elastic systems etcd-v3).
Issue 52's shape: add ``--optimizer sgd --batch 64 --steps 70 --warmup 10`` (``bench/live_shape_check.py`` runs it
with a worker of its own). ``--threads`` (default 1) sets each worker's torch threads; 0 leaves torch's default, as
torchrun does with one worker per agent: on 2 cores that is 2 threads x 2 workers + gloo's, and the step times
spread 3-5x (OpenMP threads preempted at their barriers), so rounds scatter +-25 % (docs/benchmarks.md).

On ``--device cuda``: an MLP + AdamW with ``--state-gib`` GiB of state (default 1.5), one worker (NCCL), and
the checkpoint intervals of ``--save-every`` (default ``0,50,10``; 0 = no checkpoints), so that each system's
rate with a snapshot every K steps is set against its rate without; goal: a durable snapshot every 50 steps
keeps >= 0.95 of the no-checkpoint rate where the disk absorbs it (bench/_disk.py: the state written per second,
state / (interval x step), at most 0.8 of ``dd``'s write rate of the checkpoint directory, measured first).
``absorbed`` among ``--save-every`` (with 0) is the shortest interval, a multiple of 10 steps, at which it does: worked
out from ``dd`` and the first round's elastic run without snapshots, and then used by every system (its runs last
long enough for 3 snapshots among the timed steps: ``--steps`` or more, at most 4x). Each interval's
line says whether the disk absorbs it and how many snapshots were taken and deferred.
With interval 0 among ``--save-every``, each run with snapshots is also set against the same round's run of the same
system without (bench/_attribution.py; issue 29, part 3): milliseconds per snapshot lost in the save's own steps
(the save call, the fence, the stall of the steps the copy overlaps) and in the rest of the interval (the drain on
the copy engine, the writer's and hasher's threads, the allocator), with GC pauses and the background threads' CPU
measured directly.

    python bench/loop_overhead_bench.py [--rounds 3] [--steps 400] [--with-local] [--with-live]
    python bench/loop_overhead_bench.py --model mlp --agents 2 --with-live --save-every 0
    python bench/loop_overhead_bench.py --model mlp --agents 2 --with-live --save-every 0 --optimizer sgd \
        --batch 64 --steps 70 --warmup 10 --rounds 7                                   # issue 52's shape
    python bench/loop_overhead_bench.py --device cuda [--state-gib 1.5] [--save-every 0,50,10]
    python bench/loop_overhead_bench.py --device cuda --save-every 0,50,absorbed     # issue 29's goal, side by side

The user's own ``DataLoader`` (issue 49; these parts replace the snapshot comparison, JSON by default in
``results/loop_overhead_loader.json``). ``--loader``: the loop fed by a ``DataLoader`` of ``--loader-workers``
(default 2) persistent workers over an ``ElasticBatchSampler``, in its short form (``trainer.batches()``) and its
own-step form (``trainer.steps()``), against plain DDP fed by the same ``DataLoader`` over a ``DistributedSampler``
(same batch, same model), ``--nproc`` ranks, no snapshots (no checkpoint storage at all); goal: the loop >= 0.98
of DDP's step rate. ``--data-bound``: a ``__getitem__`` that costs ``--data-cost`` (default 1.0) times the step's
CPU time per batch (a pure-Python busy loop sized by a calibration run: the model's step on one thread, without
torchrun), on ``--data-bound-nproc`` rank(s) (default 1), comparing (a) the loop collating a plain data set
in-process, (b) the loop with the ``DataLoader``, (c) plain DDP with the ``DataLoader``, and (d) the loop without
the data cost (the step alone): with workers the loop should keep (d)'s rate, where (a) roughly halves it.
On 2 cores, 2 ranks x 2 workers oversubscribe the machine (6 processes); the char data set's ``__getitem__`` is a
slice, so in ``--loader`` the workers mostly wait; the data-bound case runs 1 rank, whose 2 workers share the
other core (the comparison means something only while the cores are not otherwise busy).

    python bench/loop_overhead_bench.py --loader --data-bound --rounds 3 --steps 200     # about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _attribution import NEAR_STEPS, StepTrace, attribute  # bench/ is the script's directory: on sys.path
from _disk import ABSORB_FRACTION, GiB, MiB, absorbed_interval, absorbs, dd_write_bytes_per_s

from elastic import compat
from elastic.contract.env import LOCAL_SNAPSHOT_DIR, LOCAL_SNAPSHOT_EVERY
from elastic.testing.etcd_server import LocalEtcdCluster, free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_overhead_worker.py"
GOAL_KEPT = 0.95  # issue 29: the loop's rate with snapshots over its rate without, where the disk absorbs them
ABSORBED = "absorbed"  # the --save-every token: the shortest interval the disk absorbs (bench/_disk.py)


def parse_intervals(text: str) -> list[str]:
    """``--save-every``'s labels, in the order the first round runs them: ``0`` first (``absorbed`` is worked out
    from its elastic run), ``absorbed`` last."""
    labels = [k.strip() for k in text.split(",") if k.strip()]
    for k in labels:
        if k != ABSORBED and not (k.isdigit()):
            raise SystemExit(f"--save-every: {k!r} is neither a number of steps (0: none) nor {ABSORBED!r}")
    if len(set(labels)) != len(labels) or not labels:
        raise SystemExit(f"--save-every: each interval once, at least one: {text!r}")
    if ABSORBED in labels and "0" not in labels:
        raise SystemExit(f"--save-every: {ABSORBED!r} needs 0 among the intervals (it is worked out from that run)")
    return sorted(labels, key=lambda k: (k != "0", k == ABSORBED))


def _run(
    mode: str,
    etcd: LocalEtcdCluster,
    args: argparse.Namespace,
    work: Path,
    save_every: int | None,
    steps: int | None = None,
    worker_args: Sequence[str] = (),
    nproc: int | None = None,
) -> dict[str, Any]:
    """One run of ``mode`` under torchrun: ``steps`` (default ``--steps``), a snapshot every ``save_every`` (None:
    no checkpoint storage at all, so no snapshot either, not even at an epoch's end), ``nproc`` workers (default
    ``--nproc``); ``worker_args``: more of the worker's arguments. A mode named ``plain...`` is plain DDP."""
    out = work / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    run_id = f"ovh-{uuid.uuid4().hex[:6]}"
    plain = mode.startswith("plain")
    if plain:  # stock torchrun: one agent standalone, several on torch's c10d rendezvous
        rdzv = (
            ["--standalone"]
            if args.agents == 1
            else ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}"]
        )
    else:
        rdzv = ["--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={run_id}"]
        if mode == "live":
            rdzv.append("--rdzv-conf=recovery=live")
    worker_mode = "plain" if plain else "live" if mode == "live" else "elastic"
    per_agent = (nproc or args.nproc) // args.agents
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.agents}",
        f"--nproc-per-node={per_agent}",
        *rdzv,
        str(WORKER),
        "--mode",
        worker_mode,
        "--steps",
        str(steps or args.steps),
        "--when-writer-busy",
        "wait" if mode == "elastic-wait" else "defer",
        "--nodes",
        str(args.agents),
        "--out",
        str(out),
        "--model",
        args.model,
        "--device",
        args.device,
        "--state-gib",
        str(args.state_gib),
        "--batch",
        str(args.batch),
        "--warmup",
        str(args.warmup),
        "--optimizer",
        args.optimizer,
        "--threads",
        str(args.threads),
        *worker_args,
    ]
    if args.width:
        cmd += ["--width", str(args.width)]
    if save_every is not None:  # the same checkpoint interval for both: plain DDP's torch.save from rank 0
        cmd += ["--checkpoint-url", str(work / f"ck-{uuid.uuid4().hex[:6]}"), "--save-every", str(save_every)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if not args.threads:  # torch's default, as torchrun leaves it with one worker per agent
        env.pop("OMP_NUM_THREADS")
    compat.disable_shared_rdzv_store(env, override=True)  # the --standalone run too: both alike
    env.pop(LOCAL_SNAPSHOT_EVERY, None)
    if mode == "elastic-local":  # in memory where there is a /dev/shm, as in production
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
        env.update({LOCAL_SNAPSHOT_EVERY: "1", LOCAL_SNAPSHOT_DIR: str(shm / f"etrain-ovh-{out.stem}")})
    try:
        agents = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(args.agents)
        ]
        results = [a.communicate(timeout=900) for a in agents]
    finally:
        if LOCAL_SNAPSHOT_DIR in env:
            shutil.rmtree(env[LOCAL_SNAPSHOT_DIR], ignore_errors=True)
        for ck in work.glob("ck-*"):
            shutil.rmtree(ck, ignore_errors=True)  # GBs per run on a GPU machine
    for agent, (_, stderr) in zip(agents, results, strict=True):
        if agent.returncode != 0:
            raise RuntimeError(f"{mode} run failed ({agent.returncode}):\n{stderr[-4000:]}")
    got: dict[str, Any] = json.loads(out.read_text())
    return got


def _snapshot_counts(snapshots: dict[str, int]) -> str:
    """`` (6 snapshots, 2 deferred)``: what a run saved (plain DDP: its torch.save calls)."""
    if not snapshots:
        return ""
    out = f" ({snapshots.get('saved', 0)} snapshots"
    if snapshots.get("deferred"):
        out += f", {snapshots['deferred']} deferred: the writer was busy"
    if snapshots.get("skipped"):
        out += f", {snapshots['skipped']} skipped"
    return out + ")"


def _print_attribution(
    traces: dict[tuple[str, str], list[StepTrace]], modes: list[str], every_of: dict[str, int]
) -> dict[str, Any]:
    """Each round's run with snapshots against the same round's run of the same system without (issue 29, part 3:
    bench/_attribution.py); medians over the rounds, milliseconds per snapshot. Keyed ``mode/interval`` (the
    absorbed interval under its number too)."""
    out: dict[str, Any] = {}
    for mode in modes:
        for label, every in ((k, e) for k, e in every_of.items() if e):
            rows = [attribute(t, b, every) for t, b in zip(traces[mode, label], traces[mode, "0"], strict=True)]
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            out[f"{mode}/{every}"] = {"median": med, "rounds": rows, "label": label}
            print(
                f"{mode}, a snapshot every {every} steps, vs no snapshots (ms per snapshot, median of {len(rows)} "
                f"rounds; base step {med['base_step_ms']:.2f} ms, mean): loss {med['loss_ms']:.1f} = save's "
                f"{NEAR_STEPS} steps {med['near_ms']:.1f} + the other {every - NEAR_STEPS} {med['far_ms']:.1f}; "
                f"GC {med['gc_ms']:+.1f}, background threads' CPU {med['background_cpu_ms']:+.1f}"
            )
    return out


def _live_report(
    rates: dict[tuple[str, str], list[float]], cpu_rates: dict[tuple[str, str], list[float]], label: str
) -> dict[str, Any]:
    """Live recovery against the loop with DDP and against plain DDP (issue 52): each round's ratio (the two runs of a
    round are neighbours in time, so a slow spell of the machine mostly hits both), their median and spread, wall and
    per CPU-second of rank 0. Goal: the median of the rounds' ratios to the loop with DDP >= 0.97."""
    med = statistics.median
    out: dict[str, Any] = {"live_steps_per_s": rates["live", label], "live_steps_per_cpu_s": cpu_rates["live", label]}
    for base, name in (("elastic", "the elastic loop with DDP"), ("plain", "plain DDP")):
        per = [a / b for a, b in zip(rates["live", label], rates[base, label], strict=True)]
        per_cpu = [a / b for a, b in zip(cpu_rates["live", label], cpu_rates[base, label], strict=True)]
        out[f"vs_{base}"] = {"rounds": per, "median": med(per), "cpu_rounds": per_cpu, "cpu_median": med(per_cpu)}
        goal = ""
        if base == "elastic":
            out["goal_met"] = med(per) >= 0.97
            goal = f"; goal >= 0.97: {'met' if out['goal_met'] else 'MISSED'}"
        print(
            f"live recovery / {name}: median of {len(per)} rounds {med(per):.3f} (rounds "
            f"{', '.join(f'{x:.2f}' for x in per)}; spread {min(per):.2f}-{max(per):.2f}); per CPU-second of rank 0 "
            f"{med(per_cpu):.3f}{goal}"
        )
    return out


# issue 49's systems: what each one is (its name starts with "plain": plain DDP, else the elastic loop)
LOADER_SYSTEMS = {
    "plain-loader": "plain DDP + DataLoader(DistributedSampler)",
    "elastic-loader": "elastic loop, short form + DataLoader(ElasticBatchSampler)",
    "elastic-loader-own": "elastic loop, own-step form + DataLoader(ElasticBatchSampler)",
    "elastic-inproc": "elastic loop, short form, the data set collated in-process",
    "elastic-alone": "elastic loop, short form, in-process, no data cost (the step alone)",
}
GOAL_LOADER = 0.98  # issue 49: the loop with the user's DataLoader over plain DDP with the same DataLoader


def _worker_args(system: str, args: argparse.Namespace, spin: int) -> list[str]:
    """The worker's arguments for one of :data:`LOADER_SYSTEMS`, with ``spin`` iterations per sample."""
    out = ["--sample-spin", str(spin)] if spin and system != "elastic-alone" else []
    if "loader" in system:
        out += ["--loader-workers", str(args.loader_workers), "--loader-context", args.loader_context]
    if system.endswith("-own"):
        out += ["--form", "own"]
    return out


def _compare(
    systems: list[str], etcd: LocalEtcdCluster, args: argparse.Namespace, work: Path, nproc: int, spin: int = 0
) -> dict[str, dict[str, list[float]]]:
    """``--rounds`` interleaved rounds of ``systems`` (every other round in reverse order), no snapshots; each
    one's wall-clock steps/s and steps per CPU-second of rank 0, per round."""
    rates: dict[str, dict[str, list[float]]] = {m: {"steps_per_s": [], "steps_per_cpu_s": []} for m in systems}
    for i in range(args.rounds):
        for system in systems if i % 2 == 0 else list(reversed(systems)):
            got = _run(system, etcd, args, work, None, worker_args=_worker_args(system, args, spin), nproc=nproc)
            rates[system]["steps_per_s"].append(float(got["steps_per_s"]))
            rates[system]["steps_per_cpu_s"].append(float(got["steps_per_cpu_s"]))
            print(
                f"round {i + 1} {system:18s} {got['steps_per_s']:7.2f} steps/s wall, {got['steps_per_cpu_s']:7.2f} "
                "steps/CPU-s",
                flush=True,
            )
    return rates


def _calibrate(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """The model's step in CPU seconds (one thread, no torchrun) and the busy loop's iterations per CPU second."""
    out = work / "calibrate.json"
    cmd = [
        sys.executable,
        str(WORKER),
        "--mode",
        "calibrate",
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--state-gib",
        str(args.state_gib),
        "--steps",
        "40",
        "--warmup",
        "10",
        "--out",
        str(out),
    ]
    if args.width:
        cmd += ["--width", str(args.width)]
    subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True, timeout=300)
    got: dict[str, float] = json.loads(out.read_text())
    return got


def _loader_parts(args: argparse.Namespace) -> None:
    """``--loader`` and ``--data-bound`` (issue 49): see the module docstring."""
    med = statistics.median
    work = Path(tempfile.mkdtemp(prefix="overhead-loader-"))
    w = args.loader_workers
    model = (
        "TinyTransformer (char, 2 layers, width 64)"
        if args.model == "char"
        else f"MLP + AdamW (width {args.width or 'default'})"
    )
    result: dict[str, Any] = {
        "model": model,
        "batch_per_rank": args.batch,
        "loader_workers": w,
        "loader_context": args.loader_context,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "snapshots": "none (no checkpoint URL)",
        "load_average_start": os.getloadavg(),
    }
    print(
        f"{os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.2f} at start; {model}, batch {args.batch} per "
        f"rank, {args.steps} steps per run ({args.warmup} not timed), {args.rounds} interleaved rounds, no "
        "snapshots",
        flush=True,
    )
    with LocalEtcdCluster(1, workdir=work / "etcd") as etcd:
        if args.loader:
            procs = args.nproc * (1 + w)
            idle = (
                "; the char data set's __getitem__ is a slice, so the workers mostly wait"
                if (args.model == "char")
                else ""
            )
            print(
                f"DataLoader, {args.nproc} ranks x {w} persistent workers each: {procs} processes on "
                f"{os.cpu_count()} cores{' (oversubscribed)' if procs > (os.cpu_count() or 1) else ''}{idle}",
                flush=True,
            )
            systems = ["plain-loader", "elastic-loader", "elastic-loader-own"]
            rates = _compare(systems, etcd, args, work, args.nproc)
            plain, plain_cpu = med(rates["plain-loader"]["steps_per_s"]), med(rates["plain-loader"]["steps_per_cpu_s"])
            part: dict[str, Any] = {"nproc": args.nproc, "processes": procs, "systems": rates}
            print(f"{LOADER_SYSTEMS['plain-loader']}: median {plain:.2f} steps/s")
            for system in systems[1:]:
                rate, cpu_rate = med(rates[system]["steps_per_s"]), med(rates[system]["steps_per_cpu_s"])
                ratio, cpu_ratio = rate / plain, cpu_rate / plain_cpu
                part[f"{system}_ratio_median"], part[f"{system}_cpu_ratio_median"] = ratio, cpu_ratio
                part[f"{system}_goal_met"] = ratio >= GOAL_LOADER
                # each round's own ratio too (a round's runs are neighbours in time: a drift of the machine's speed
                # over the run, as load from before decays, hits both)
                mine, base = rates[system]["steps_per_s"], rates["plain-loader"]["steps_per_s"]
                per = [a / b for a, b in zip(mine, base, strict=True)]
                part[f"{system}_round_ratios"] = per
                print(
                    f"{LOADER_SYSTEMS[system]}: median {rate:.2f} steps/s, ratio {ratio:.3f} (goal >= "
                    f"{GOAL_LOADER}: {'met' if ratio >= GOAL_LOADER else 'MISSED'}); per CPU-second of rank 0: "
                    f"{cpu_ratio:.3f}; rounds' own ratios {', '.join(f'{x:.2f}' for x in per)} (median "
                    f"{med(per):.3f})",
                    flush=True,
                )
            result["loader"] = part
        if args.data_bound:
            cal = _calibrate(args, work)
            spin = max(1, round(cal["spin_per_cpu_s"] * cal["step_cpu_s"] * args.data_cost / args.batch))
            batch_cpu = spin * args.batch / cal["spin_per_cpu_s"]
            n = args.data_bound_nproc
            procs = n * (1 + w)
            print(
                f"data-bound: {n} rank(s); __getitem__ spins {spin} iterations = {batch_cpu * 1e3:.1f} ms of CPU per "
                f"batch of {args.batch} = {args.data_cost:.2f} x the step's {cal['step_cpu_s'] * 1e3:.1f} ms of CPU "
                f"(calibrated on one thread); with the DataLoader {procs} processes on {os.cpu_count()} cores: "
                f"the rank's own core, its {w} workers share the rest",
                flush=True,
            )
            systems = ["elastic-alone", "elastic-inproc", "elastic-loader", "plain-loader"]
            rates = _compare(systems, etcd, args, work, n, spin)
            m = {s: med(rates[s]["steps_per_s"]) for s in systems}
            alone = m["elastic-alone"]
            for key, system in zip("dabc", systems, strict=True):
                print(
                    f"({key}) {LOADER_SYSTEMS[system]}: median {m[system]:.2f} steps/s = "
                    f"{m[system] / alone:.3f} of the step alone"
                )
            b_c, b_a = m["elastic-loader"] / m["plain-loader"], m["elastic-loader"] / m["elastic-inproc"]
            print(
                f"the loop with workers / plain DDP with workers (b/c): {b_c:.3f}; the loop with workers / "
                f"in-process (b/a): {b_a:.3f}",
                flush=True,
            )
            result["data_bound"] = {
                "nproc": n,
                "processes": procs,
                "data_cost": args.data_cost,
                "calibration": cal,
                "spin": spin,
                "batch_cpu_s": batch_cpu,
                "systems": rates,
                "medians": m,
                "fraction_of_alone": {s: m[s] / alone for s in systems},
                "loader_vs_plain_loader": b_c,
                "loader_vs_inproc": b_a,
            }
    shutil.rmtree(work, ignore_errors=True)
    result["load_average_end"] = os.getloadavg()
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=None, help="default: 5 with --with-live, else 3")
    parser.add_argument("--steps", type=int, default=None, help="per run (default: 400 on cpu, 300 on cuda)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed (default: 20 on cpu, 30 on cuda)")
    parser.add_argument(
        "--save-every",
        default=None,
        help="checkpoint interval(s), comma-separated, 0 = none (default: 100 on cpu, 0,50,10 on cuda)",
    )
    parser.add_argument("--state-gib", type=float, default=1.5, help="--device cuda: state of the MLP + AdamW")
    parser.add_argument("--batch", type=int, default=None, help="per worker (default: 16 on cpu, 1024 on cuda)")
    parser.add_argument("--nproc", type=int, default=None, help="workers in all (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--agents", type=int, default=1, help="torchrun agents, the workers split among them")
    parser.add_argument("--model", choices=["char", "mlp"], default=None, help="default: char on cpu, mlp on cuda")
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="--model mlp: layer width (default: 1024 on cpu with 4 layers, 8192 on cuda)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="default: results/loop_overhead.json, results/loop_overhead_loader.json with --loader or --data-bound",
    )
    parser.add_argument("--with-local", action="store_true", help="also the elastic loop + node-local snapshots")
    parser.add_argument("--with-wait", action="store_true", help="also the elastic loop with when_writer_busy=wait")
    parser.add_argument("--with-live", action="store_true", help="also the elastic loop in live recovery mode")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="every system's optimizer")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="cpu: torch's threads per worker (OMP_NUM_THREADS too); 0: torch's default (one per core), as torchrun "
        "leaves it with one worker per agent",
    )
    parser.add_argument("--loader", action="store_true", help="the loop with a DataLoader vs plain DDP with one")
    parser.add_argument("--data-bound", action="store_true", help="a costly __getitem__: in-process vs DataLoader")
    parser.add_argument("--loader-workers", type=int, default=2, help="--loader, --data-bound: per rank")
    parser.add_argument(
        "--loader-context",
        choices=["fork", "forkserver", "spawn"],
        default="fork",
        help="the DataLoader's multiprocessing_context",
    )
    parser.add_argument(
        "--data-cost", type=float, default=1.0, help="--data-bound: a batch's __getitem__ CPU over the step's"
    )
    parser.add_argument("--data-bound-nproc", type=int, default=1, help="--data-bound: ranks")
    args = parser.parse_args()
    loader_parts = args.loader or args.data_bound
    args.json = args.json or HERE / "results" / ("loop_overhead_loader.json" if loader_parts else "loop_overhead.json")
    cuda = args.device == "cuda"
    args.model = args.model or ("mlp" if cuda else "char")
    if args.model == "mlp" and not cuda and args.width is None:  # 4 x 1024^2 + AdamW: all-reduce ~1/3 of a step
        args.width = 1024
        if "--state-gib" not in sys.argv:
            args.state_gib = 4 * 1024 * 1024 * 4 * 3 / 2**30
    args.rounds = args.rounds or (5 if args.with_live else 3)
    args.steps = args.steps or (300 if cuda else 400)
    args.warmup = args.warmup if args.warmup is not None else (30 if cuda else 20)
    args.batch = args.batch or (1024 if cuda else 16)
    args.nproc = args.nproc or (1 if cuda else 2)
    if args.nproc % args.agents:
        parser.error(f"--nproc {args.nproc} does not split over --agents {args.agents}")
    if loader_parts:
        _loader_parts(args)
        return
    labels = parse_intervals(args.save_every or ("0,50,10" if cuda else "100"))
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    extra = [
        m
        for m, wanted in (
            ("elastic-local", args.with_local),
            ("elastic-wait", args.with_wait),
            ("live", args.with_live),
        )
        if wanted
    ]
    modes = ("plain", "elastic", *extra)
    every_of = {k: int(k) for k in labels if k != ABSORBED}  # the absorbed interval joins after round 1's base run
    rates: dict[tuple[str, str], list[float]] = {(m, k): [] for m in modes for k in labels}
    cpu_rates: dict[tuple[str, str], list[float]] = {(m, k): [] for m in modes for k in labels}
    traces: dict[tuple[str, str], list[StepTrace]] = {(m, k): [] for m in modes for k in labels}
    snapshots: dict[tuple[str, str], list[dict[str, int]]] = {(m, k): [] for m in modes for k in labels}
    state_bytes = int(args.state_gib * GiB) if args.model == "mlp" else 0  # the char model's: from its first run
    disk_bps = dd_write_bytes_per_s(work, max(256 * MiB, state_bytes))  # where the snapshots go: the same disk
    print(
        f"disk: dd writes {disk_bps / MiB:.0f} MiB/s in {work} (conv=fsync, {max(256 * MiB, state_bytes) / MiB:.0f} "
        "MiB)",
        flush=True,
    )
    with LocalEtcdCluster(1, workdir=work / "etcd") as etcd:
        for i in range(args.rounds):
            order = [(m, k) for k in labels for m in modes]
            for mode, label in order if i % 2 == 0 else reversed(order):
                # a long absorbed interval: 3 snapshots among the timed steps (rates are per step), up to 4x --steps
                steps = args.steps
                if label == ABSORBED:
                    steps = min(4 * args.steps, max(args.steps, args.warmup + 3 * every_of[label]))
                got = _run(mode, etcd, args, work, every_of[label], steps)
                rate, cpu_rate = float(got["steps_per_s"]), float(got["steps_per_cpu_s"])
                state_bytes = state_bytes or int(got.get("state_bytes", 0))
                traces[mode, label].append(StepTrace.from_json(got))
                rates[mode, label].append(rate)
                cpu_rates[mode, label].append(cpu_rate)
                snapshots[mode, label].append(got.get("snapshots", {}))
                taken = _snapshot_counts(got.get("snapshots", {})) if every_of[label] else ""
                timed = max(1, len(got.get("step_seconds", [])))
                print(
                    f"round {i + 1} {mode:13s} snapshot every {every_of[label] or '-':>4} steps: {rate:7.2f} steps/s "
                    f"wall, {cpu_rate:7.2f} steps/CPU-s (main thread {got['main_cpu_s'] * 1e3 / timed:.1f} ms CPU, "
                    f"GC {got['gc_s'] * 1e3 / timed:.2f} ms a step){taken}",
                    flush=True,
                )
                if label == "0" and mode == "elastic" and ABSORBED in labels and ABSORBED not in every_of:
                    every_of[ABSORBED] = absorbed_interval(max(1, state_bytes), 1.0 / rate, disk_bps)
                    print(
                        f"the disk absorbs a snapshot every {every_of[ABSORBED]} steps: {state_bytes / MiB:.0f} MiB "
                        f"per {every_of[ABSORBED]} x {1e3 / rate:.2f} ms <= {ABSORB_FRACTION} x dd",
                        flush=True,
                    )
    shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    step_s = 1.0 / med(rates["elastic", "0"]) if "0" in labels else None  # the loop's own step, without snapshots
    by_interval = {}
    for label in labels:
        every = every_of[label]
        row: dict[str, Any] = {"every": every, "snapshots": {m: snapshots[m, label] for m in modes}}
        row |= {f"{m}_steps_per_s": rates[m, label] for m in modes}
        row |= {f"{m}_steps_per_cpu_s": cpu_rates[m, label] for m in modes}
        row["ratio_median"] = med(rates["elastic", label]) / med(rates["plain", label])
        if "0" in labels:
            row |= {f"{m}_fraction_of_no_checkpoint": med(rates[m, label]) / med(rates[m, "0"]) for m in modes}
        if every and step_s is not None and state_bytes:
            row["written_bytes_per_s"] = state_bytes / (every * step_s)
            row["disk_absorbs"] = absorbs(state_bytes, every, step_s, disk_bps)
        by_interval[label] = row
        plain, elastic = med(rates["plain", label]), med(rates["elastic", label])
        line = (
            f"snapshot every {every or '-':>4} steps: plain DDP median {plain:.2f} steps/s, "
            f"elastic median {elastic:.2f} steps/s, ratio {row['ratio_median']:.3f}"
        )
        if "0" in labels and every:
            line += "; of the same system without checkpoints: " + ", ".join(
                f"{m} {row[f'{m}_fraction_of_no_checkpoint']:.3f}" for m in modes
            )
        if "disk_absorbs" in row:
            line += (
                f"; writes {row['written_bytes_per_s'] / MiB:.0f} MiB/s = "
                f"{row['written_bytes_per_s'] / disk_bps:.2f} of dd: the disk "
                f"{'absorbs it' if row['disk_absorbs'] else 'does NOT absorb it'}"
            )
        print(line)
    main_label = next((k for k in labels if every_of[k]), labels[0])
    main_every = every_of[main_label]
    first = by_interval[main_label]
    backend = "nccl, cuda" if cuda else "gloo, CPU"
    workers = f"{args.nproc} worker(s) on {args.agents} torchrun agent(s), {backend}"
    result = {
        "model": f"MLP + AdamW (width {args.width or 'default'}), {args.state_gib:.3f} GiB of state, batch "
        f"{args.batch}/worker, {workers}"
        if args.model == "mlp"
        else f"TinyTransformer (char, 2 layers, width 64), batch {args.batch}/worker, {workers}",
        "checkpoint_every_steps": main_every,
        "checkpoint_every_label": main_label,
        "disk": {"dd_write_bytes_per_s": disk_bps, "state_bytes": state_bytes, "absorb_fraction": ABSORB_FRACTION},
        "absorbed_every_steps": every_of.get(ABSORBED),
        "plain_ddp_steps_per_s": first["plain_steps_per_s"],
        "elastic_steps_per_s": first["elastic_steps_per_s"],
        "ratio_median": first["ratio_median"],
        "plain_ddp_steps_per_cpu_s": first["plain_steps_per_cpu_s"],
        "elastic_steps_per_cpu_s": first["elastic_steps_per_cpu_s"],
        "cpu_ratio_median": med(first["elastic_steps_per_cpu_s"]) / med(first["plain_steps_per_cpu_s"]),
        "by_interval": by_interval,
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not cuda:
        print(
            f"per CPU-second of rank 0: ratio {result['cpu_ratio_median']:.3f} (robust to other load; goal >= 0.98 "
            "on the wall-clock ratio)"
        )
    if "0" in by_interval:  # issue 29's goal: >= 0.95 where the disk absorbs the snapshots
        for label in (k for k in labels if every_of[k]):
            row = by_interval[label]
            kept = row["elastic_fraction_of_no_checkpoint"]
            row["goal_met"] = kept >= GOAL_KEPT if row.get("disk_absorbs", True) else None  # None: not applicable
            verdict = {True: "met", False: "MISSED", None: "not applicable: the disk does not absorb it"}[
                row["goal_met"]
            ]
            print(
                f"elastic loop, a snapshot every {every_of[label]} steps: {kept:.3f} of its no-checkpoint rate "
                f"(goal >= {GOAL_KEPT} where the disk absorbs it: {verdict})"
            )
    if args.with_local:
        el, lo = rates["elastic", main_label], rates["elastic-local", main_label]
        lc = med(cpu_rates["elastic-local", main_label]) / med(cpu_rates["elastic", main_label])
        result.update(
            elastic_local_steps_per_s=lo,
            elastic_local_steps_per_cpu_s=cpu_rates["elastic-local", main_label],
            local_vs_elastic_ratio=med(lo) / med(el),
            local_vs_elastic_cpu_ratio=lc,
        )
        print(
            f"elastic + node-local snapshot every step median {med(lo):.2f} steps/s: {med(lo) / med(el):.3f} "
            f"of the elastic loop without it ({lc:.3f} per CPU-second of rank 0)"
        )
    if args.with_live:
        result["live"] = _live_report(rates, cpu_rates, main_label)
    if "0" in labels:
        result["attribution"] = _print_attribution(traces, [m for m in modes if m != "plain"], every_of)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
