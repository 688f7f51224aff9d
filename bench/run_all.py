"""All benchmarks in one command: this project vs stock torchrun, one JSON and one Markdown table.

    python bench/run_all.py --quick     # about 15 minutes on 2 cores
    python bench/run_all.py --full      # about 40 minutes on 2 cores

Runs, in this order, on one local etcd per part (no network beyond loopback):

- ``recovery_bench``: worker SIGKILL -> next completed step, node (agent + workers) SIGKILL -> the
  survivor's next step, lost steps per failure; this project vs torchrun c10d (defaults, and
  ``last_call_timeout=1``), all on the same training script (``elastic/testing/train_worker.py``);
  then the same for this project with a snapshot every step; then goodput with one failure every 30 s;
- ``rendezvous_bench``: rendezvous time for N participants (etcd-v3 vs c10d);
- ``checkpoint_bench`` (subprocess): checkpoint blocking time vs synchronous ``torch.save``, and as a
  fraction of a training step;
- ``loop_overhead_bench`` (subprocess): steady-state step rate of the elastic loop vs plain DDP;
- ``api_load_bench``: controller ``GET /v1/jobs/{id}`` throughput and p99 latency.

Every figure is a median and a p95 over the trials (nearest rank: with few trials p95 is the maximum).
Writes ``bench/results/summary.json`` and ``bench/results/summary.md`` (plus each part's own JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import api_load_bench  # noqa: E402
import recovery_bench  # noqa: E402

OURS = "etcd-v3-warm"  # what the service runs by default: the etcd-v3 rendezvous + warm starts (elastic.prefork)
LOCAL = "etcd-v3-local"  # the same + a node-local snapshot every step (JobSpec.local_snapshot_every=1)
LIVE = "etcd-v3-live"  # live recovery: the workers keep their processes (ElasticConfig(recovery="live"))
import rendezvous_bench  # noqa: E402
from _stats import summarize  # noqa: E402

from elastic.testing.etcd_server import LocalEtcdCluster  # noqa: E402


@dataclass(frozen=True)
class Plan:
    kill_trials: int
    every_step_trials: int
    goodput_duration: float
    rdzv_sizes: tuple[int, ...]
    rdzv_trials: int
    ckpt_size_mb: int
    ckpt_repeats: int
    overhead_rounds: int
    api_rounds: int
    api_duration: float


PLANS = {
    "quick": Plan(2, 2, 90.0, (2, 8, 32), 2, 50, 3, 1, 2, 5.0),
    "full": Plan(5, 3, 180.0, (2, 8, 32, 64), 3, 200, 5, 3, 3, 10.0),
}
INTERVAL = 30.0


def _subprocess(cmd: list[str], timeout: float) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, env=env, timeout=timeout)


def _machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg()[0],
    }


def run(
    plan: Plan, workdir: Path, results: Path, only: set[str] | None, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the wanted parts into ``out``; a part that fails is recorded in ``out["errors"]`` and the
    others still run; ``results/summary.json`` is rewritten after every part."""
    out = out if out is not None else {}
    out.setdefault("machine", _machine())
    out.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    systems = list(recovery_bench.SYSTEMS.values())

    def recovery() -> None:
        with LocalEtcdCluster(1, workdir=workdir / "etcd-recovery") as etcd:
            base = recovery_bench.Workload()
            out["recovery_workload"] = vars(base)
            out["kills"] = recovery_bench.bench_kills(systems, plan.kill_trials, etcd, workdir, base)
            _save(out, results)
            every = recovery_bench.Workload(save_every=1)
            out["kills_every_step"] = recovery_bench.bench_kills(
                [recovery_bench.SYSTEMS[OURS]], plan.every_step_trials, etcd, workdir, every, seed=1
            )
            _save(out, results)
            out["goodput"] = recovery_bench.bench_goodput(
                systems, 1, etcd, workdir, base, plan.goodput_duration, INTERVAL
            )

    def detect() -> None:
        with LocalEtcdCluster(1, workdir=workdir / "etcd-detect") as etcd:
            out["kills_fast_detect"] = recovery_bench.bench_kills(
                [recovery_bench.FAST_DETECT], plan.kill_trials, etcd, workdir, recovery_bench.Workload(), seed=2
            )

    def rendezvous() -> None:
        with LocalEtcdCluster(1, workdir=workdir / "etcd-rdzv") as etcd:
            out["rendezvous"] = rendezvous_bench.bench_rendezvous(list(plan.rdzv_sizes), plan.rdzv_trials, etcd)

    def checkpoint() -> None:
        path = results / "checkpoint.json"
        _subprocess(
            [
                sys.executable,
                str(HERE / "checkpoint_bench.py"),
                "--size-mb",
                str(plan.ckpt_size_mb),
                "--repeats",
                str(plan.ckpt_repeats),
                "--no-s3",
                "--out",
                str(path),
            ],
            1200,
        )
        out["checkpoint"] = json.loads(path.read_text())

    def overhead() -> None:
        path = results / "loop_overhead.json"
        _subprocess(
            [
                sys.executable,
                str(HERE / "loop_overhead_bench.py"),
                "--rounds",
                str(plan.overhead_rounds),
                "--json",
                str(path),
            ],
            1800,
        )
        out["loop_overhead"] = json.loads(path.read_text())

    def api() -> None:
        out["api"] = api_load_bench.bench_api(plan.api_rounds, plan.api_duration, 8, workdir / "api")

    parts: dict[str, Callable[[], None]] = {
        "recovery": recovery,
        "detect": detect,
        "rendezvous": rendezvous,
        "checkpoint": checkpoint,
        "overhead": overhead,
        "api": api,
    }
    for name, part in parts.items():
        if only is not None and name not in only:
            continue
        began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            part()
            out.setdefault("part_times", {})[name] = [began, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())]
        except Exception as exc:  # reported in the summary; the other parts still run
            out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            print(f"part {name} FAILED: {exc}", file=sys.stderr, flush=True)
        _save(out, results)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out["machine"]["load_average_at_end"] = os.getloadavg()[0]
    return out


def _save(data: dict[str, Any], results: Path) -> None:
    (results / "summary.json").write_text(json.dumps(data, indent=2))


# -- the summary ---------------------------------------------------------------------------------------
def _fmt(stat: dict[str, Any] | None, unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    if not stat or stat.get("median") is None:
        return "—"
    return f"{stat['median'] * scale:.{digits}f} / {stat['p95'] * scale:.{digits}f} {unit}".rstrip()


def summary(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The headline figures, the goals and whether each is met, and the Markdown text."""
    figures: dict[str, Any] = {}
    goals: list[dict[str, Any]] = []
    lines: list[str] = []
    m = data["machine"]
    lines += [
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, {m['platform']}, Python {m['python']},"
        f" torch {m['torch']}; load average {m['load_average_at_start']:.1f} at start,"
        f" {m.get('load_average_at_end', float('nan')):.1f} at end. Run {data['started']} to {data.get('finished')}.",
        "",
        "Each cell: median / p95 over the trials (nearest rank; with few trials p95 is the maximum).",
        "",
    ]
    if data.get("part_times"):
        spans = ", ".join(f"{k} {a[11:16]}-{b[11:16]}Z" for k, (a, b) in data["part_times"].items())
        lines[-1:-1] = [f"Parts run at: {spans} (parts not listed: in the first run, before that).", ""]

    def goal(name: str, ok: bool | None, value: str) -> None:
        goals.append({"goal": name, "met": ok, "value": value})

    if "kills" in data:
        kills = {row["key"]: row for row in data["kills"]}
        every = {row["key"]: row for row in data.get("kills_every_step", [])}
        good = {row["key"]: row for row in data.get("goodput", [])}
        keys = [k for k in (LIVE, LOCAL, OURS, "etcd-v3", "c10d", "c10d-tuned") if k in kills]
        w = data.get("recovery_workload", {})
        lines += [
            f"### Recovery (2 agents x 1 worker, `train_worker.py`: step {w.get('step_sleep')} s of simulated"
            f" compute, snapshot every {w.get('save_every')} steps; same script for every system)",
            "",
            "| figure | " + " | ".join(kills[k]["system"] for k in keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        rows = [
            ("worker SIGKILL → next completed step", "worker_kill_next_step_s", "s", 1.0, 2),
            ("node SIGKILL (agent + workers) → survivor's next step", "node_kill_next_step_s", "s", 1.0, 2),
            ("replacement node → its worker's first step (from the agent's start)", "join_first_step_s", "s", 1.0, 2),
            ("lost steps per worker kill", "worker_kill_lost_steps", "", 1.0, 1),
            ("lost steps per node kill", "node_kill_lost_steps", "", 1.0, 1),
            ("survivor's worker PID changed per worker kill", "worker_kill_survivor_pid_changed", "", 1.0, 1),
            ("survivor's worker PID changed per node kill", "node_kill_survivor_pid_changed", "", 1.0, 1),
        ]
        for title, key, unit, scale, digits in rows:
            if not any(key in kills[k] for k in keys):
                continue  # a summary from before that figure was taken
            cells = [_fmt(kills[k].get(key), unit, scale, digits) for k in keys]
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
        if good:
            lines.append(
                f"| goodput, one failure every {INTERVAL:.0f} s ({next(iter(good.values()))['duration_s']:.0f} s run)"
                " | " + " | ".join(_fmt(good[k]["goodput"], "%", 100, 1) if k in good else "—" for k in keys) + " |"
            )
        if OURS in every:
            e = every[OURS]
            lines += [
                "",
                "This project with a **durable** snapshot every step (the other way to ≤ 1 lost step): worker kill"
                " → next step "
                f"{_fmt(e['worker_kill_next_step_s'])}, lost {_fmt(e['worker_kill_lost_steps'], '', 1, 1)}; "
                f"node kill → next step {_fmt(e['node_kill_next_step_s'])}, lost "
                f"{_fmt(e['node_kill_lost_steps'], '', 1, 1)} (median / p95).",
            ]
        for row in data.get("kills_fast_detect", []):
            lines += [
                "",
                f"{row['system']}, snapshot every 5 steps: worker kill → next step"
                f" {_fmt(row['worker_kill_next_step_s'])}, node kill → survivor's next step"
                f" {_fmt(row['node_kill_next_step_s'])} (median / p95).",
            ]
        live = kills.get(LIVE)
        if live:
            wk, nk = live["worker_kill_next_step_s"]["median"], live["node_kill_next_step_s"]["median"]
            figures.update(live_worker_kill_next_step_s=wk, live_node_kill_next_step_s=nk)
            goal("live: worker kill → survivors' next step ≤ 0.5 s", wk <= 0.5, f"{wk:.2f} s")
            goal("live: node kill → next step ≤ 0.5 s", nk <= 0.5, f"{nk:.2f} s")
            lost = max(live["worker_kill_lost_steps"]["p95"], live["node_kill_lost_steps"]["p95"])
            goal("live: 0 lost committed steps", lost == 0, f"{lost:.0f} (p95)")
            if live.get("join_first_step_s", {}).get("median") is not None:
                js = live["join_first_step_s"]["median"]
                figures["live_join_first_step_s"] = js
                goal("live: a joiner's first step ≤ 2 s after its agent starts", js <= 2.0, f"{js:.2f} s")
            if LIVE in good:
                gp = good[LIVE]["goodput"]["median"]
                figures["goodput_live"] = gp
                goal("live: goodput ≥ 98 % at one failure per 30 s", gp >= 0.98, f"{gp * 100:.1f} %")
        ours = kills.get(OURS)
        if ours:
            wk = ours["worker_kill_next_step_s"]["median"]
            nk = ours["node_kill_next_step_s"]["median"]
            figures.update(worker_kill_next_step_s=wk, node_kill_next_step_s=nk)
            goal("worker kill → next step ≤ 3 s", wk <= 3.0, f"{wk:.2f} s")
            goal("node kill → next step ≤ 5 s", nk <= 5.0, f"{nk:.2f} s")
            if "c10d" in kills:
                ratio = nk / kills["c10d"]["node_kill_next_step_s"]["median"]
                figures["node_kill_ratio_vs_c10d_defaults"] = ratio
                goal("node kill ≤ 0.15x torchrun c10d defaults", ratio <= 0.15, f"{ratio:.3f}x")
            lost = max(ours["worker_kill_lost_steps"]["median"], ours["node_kill_lost_steps"]["median"])
            goal(f"≤ 1 lost step per failure (snapshot every {w.get('save_every')} steps)", lost <= 1, f"{lost:.1f}")
            if LOCAL in kills:
                loc = kills[LOCAL]
                lost_l = max(loc["worker_kill_lost_steps"]["median"], loc["node_kill_lost_steps"]["median"])
                lost_p95 = max(loc["worker_kill_lost_steps"]["p95"], loc["node_kill_lost_steps"]["p95"])
                figures["lost_steps_node_local"] = lost_l
                goal(
                    f"≤ 1 lost step per failure (durable snapshot every {w.get('save_every')} steps + node-local"
                    " every step)",
                    lost_l <= 1,
                    f"{lost_l:.1f} (p95 {lost_p95:.1f})",
                )
            if OURS in every:
                e = every[OURS]
                lost1 = max(e["worker_kill_lost_steps"]["median"], e["node_kill_lost_steps"]["median"])
                goal("≤ 1 lost step per failure (snapshot every step)", lost1 <= 1, f"{lost1:.1f}")
            if OURS in good:
                gp = good[OURS]["goodput"]["median"]
                figures["goodput"] = gp
                goal("goodput ≥ 90 % at one failure per 30 s", gp >= 0.90, f"{gp * 100:.1f} %")
            if LOCAL in good:
                gp = good[LOCAL]["goodput"]["median"]
                figures["goodput_node_local"] = gp
                goal("goodput ≥ 90 % at one failure per 30 s (+ node-local snapshots)", gp >= 0.90, f"{gp * 100:.1f} %")
        lines.append("")
    if "rendezvous" in data:
        rows_r = data["rendezvous"]
        sizes = sorted({r["n"] for r in rows_r})
        lines += [
            "### Rendezvous time for N participants (from the last join until all N have the round)",
            "",
            "| backend, arrival | " + " | ".join(f"N={n}" for n in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        for backend in ("etcd-v3", "c10d"):
            for arrival in sorted({r["arrival"] for r in rows_r}):
                cells = []
                for n in sizes:
                    hit = [r for r in rows_r if r["backend"] == backend and r["arrival"] == arrival and r["n"] == n]
                    cells.append(_fmt(summarize(hit[0]["from_last_join_samples_s"]), "s", 1, 3) if hit else "—")
                lines.append(f"| {backend}, {arrival} | " + " | ".join(cells) + " |")
        lines.append("")
    if "checkpoint" in data or "loop_overhead" in data:
        lines += ["### Checkpoints and steady state (this project)", "", "| figure | median / p95 |", "|---|---|"]
    if "checkpoint" in data:
        c = data["checkpoint"]
        mb = c["state_bytes"] / 2**20
        sync = summarize(c["torch_save"]["blocking_s"])
        ours_b = summarize(c["ours"]["blocking_s"])
        ov = summarize(c["overlap"]["overlap_with_optimizer"]["blocking_s"])
        fb = summarize(c["overlap"]["forward_backward_s"])
        stall = ov["median"] / fb["median"]
        figures["checkpoint_stall_fraction_of_step"] = stall
        lines += [
            f"| synchronous `torch.save` of {mb:.0f} MiB (model + optimizer) | {_fmt(sync, 'ms', 1e3, 1)} |",
            f"| our async save, training blocked (copy in `save`) | {_fmt(ours_b, 'ms', 1e3, 1)} |",
            f"| our async save as the loop does it (`overlap_with=optimizer`), blocked | {_fmt(ov, 'ms', 1e3, 1)} |",
            f"| forward + backward of that model (one step's compute) | {_fmt(fb, 'ms', 1e3, 1)} |",
            f"| checkpoint stall as a fraction of a step | {stall * 100:.1f} % |",
        ]
        goal("checkpoint stall ≤ 5 % of a step", stall <= 0.05, f"{stall * 100:.1f} %")
    if "loop_overhead" in data:
        lo = data["loop_overhead"]
        el, pl = summarize(lo["elastic_steps_per_s"]), summarize(lo["plain_ddp_steps_per_s"])
        ratio = lo["ratio_median"]
        figures["steady_state_ratio"] = ratio
        every = lo.get("checkpoint_every_steps", "?")
        lines += [
            f"| plain DDP under torchrun --standalone (sync torch.save every {every} steps), steps/s "
            f"| {_fmt(pl, '', 1, 2)} |",
            f"| elastic loop (etcd-v3, async snapshot every {every} steps), steps/s | {_fmt(el, '', 1, 2)} |",
            f"| steady-state throughput, elastic / plain | {ratio:.3f} |",
        ]
        if "cpu_ratio_median" in lo:
            lines.append(f"| the same per CPU-second of rank 0 (robust to other load) | {lo['cpu_ratio_median']:.3f} |")
    lines.append("")
    if "api" in data:
        rounds = data["api"]["rounds"]
        rps, p99 = summarize([r["req_per_s"] for r in rounds]), summarize([r["p99_ms"] for r in rounds])
        p50 = summarize([r["p50_ms"] for r in rounds])
        errors = sum(r["non_200"] for r in rounds)
        figures.update(api_req_per_s=rps["median"], api_p99_ms=p99["median"])
        lines += [
            f"### Controller API: `GET /v1/jobs/{{id}}`, {data['api']['connections']} keep-alive connections,"
            f" {data['api']['duration_s']:.0f} s per round, {len(rounds)} rounds, auth on, real etcd",
            "",
            "| req/s | p50 latency | p99 latency | non-200 answers |",
            "|---|---|---|---|",
            f"| {_fmt(rps, '', 1, 0)} | {_fmt(p50, 'ms', 1, 1)} | {_fmt(p99, 'ms', 1, 1)} | {errors} |",
            "",
            "(req/s: median / p95 of the rounds' rates; latency: median / p95 over rounds of each round's percentile)",
            "",
        ]
        goal(
            "≥ 500 status req/s at p99 ≤ 50 ms",
            rps["median"] >= 500 and p99["median"] <= 50,
            f"{rps['median']:.0f} req/s, p99 {p99['median']:.1f} ms",
        )
    for part, error in data.get("errors", {}).items():
        lines += [f"**Part `{part}` failed**: {error}", ""]
    lines += ["### Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for g in goals:
        lines.append(f"| {g['goal']} | {g['value']} | {'yes' if g['met'] else '**no**'} |")
    return {"figures": figures, "goals": goals}, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode")
    mode.add_argument("--full", action="store_const", const="full", dest="mode")
    parser.add_argument("--only", default=None, help="parts: recovery,detect,rendezvous,checkpoint,overhead,api")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--summarize", type=Path, default=None, help="only re-render the summary of this JSON")
    parser.add_argument("--merge", type=Path, default=None, help="add the parts run now to this summary JSON")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.summarize is not None:
        data = json.loads(args.summarize.read_text())
    elif args.merge is not None:  # run some parts again (or new ones) into an existing summary
        data = json.loads(args.merge.read_text())
        for part in (args.only or "").split(","):
            data.get("errors", {}).pop(part, None)
        workdir = Path(tempfile.mkdtemp(prefix="bench-all-"))
        try:
            data = run(
                PLANS[args.mode or data.get("mode", "quick")],
                workdir,
                args.results,
                set(args.only.split(",")) if args.only else None,
                out=data,
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    else:
        plan = PLANS[args.mode or "quick"]
        workdir = Path(tempfile.mkdtemp(prefix="bench-all-"))
        try:
            data = run(plan, workdir, args.results, set(args.only.split(",")) if args.only else None)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        data["mode"] = args.mode or "quick"
    head, text = summary(data)
    data["summary"] = head
    (args.results / "summary.json").write_text(json.dumps(data, indent=2))
    (args.results / "summary.md").write_text(text)
    print(text)
    print(f"wrote {args.results / 'summary.json'} and {args.results / 'summary.md'}")


if __name__ == "__main__":
    main()
