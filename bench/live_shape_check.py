"""Live mode against DDP on issue 52's shape, written apart from ``loop_overhead_bench.py`` (its own worker, its own
timing) so that the two can be held against each other.

The shape: 2 torchrun agents x 1 worker on etcd-v3, gloo, a 4-layer 1024-wide MLP (ReLU between), 64 samples per
worker per step (random inputs and targets, MSE), SGD, no snapshots (no checkpoint storage), ``--warmup`` (10)
untimed steps then ``--steps`` (60) timed ones, the modes interleaved round by round (the order alternates), the
threads left as torchrun leaves them (one worker per agent: torch's default, one thread per core) unless
``--threads``. Modes:

- ``live``: the elastic loop with ``recovery="live"`` (the loop's own gradient all-reduce);
- ``ddp``: the elastic loop in restart mode (torch's DDP);
- ``plain``: stock DDP under stock torchrun (c10d rendezvous): the same model and step without the loop.

Each run's rank 0 times each committed step (wall and process CPU). Printed per round, then the median over rounds of
steps/s, steps per CPU-second, and live/ddp and live/plain ratios (each round's ratio, then their median). JSON to
``--out`` (default ``bench/results/live_shape_check.json``). ``--profile DIR``: rank 0 runs cProfile over the timed
steps of each mode's first round and writes ``DIR/<mode>.txt`` (top entries by own time and by cumulative time).

    python bench/live_shape_check.py [--rounds 5] [--steps 60] [--warmup 10] [--threads N] [--profile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("live", "ddp", "plain")


def _model(width: int, layers: int) -> Any:
    from torch import nn

    parts: list[nn.Module] = []
    for i in range(layers):
        parts.append(nn.Linear(width, width))
        if i < layers - 1:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, by thread (Python's name where it is a Python thread,
    else the kernel's; Linux /proc)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{names.get(int(task.name), comm)}:{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread used between two :func:`thread_cpu` readings, summed by name, busiest first."""
    out: dict[str, float] = {}
    for key, v in after.items():
        name = key.rsplit(":", 1)[0]
        out[name] = out.get(name, 0.0) + v - before.get(key, 0.0)
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


class Repeated:
    """``size`` samples over a smaller data set (index modulo its length)."""

    def __init__(self, data: Any, size: int) -> None:
        self._data, self._size = data, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: int) -> Any:
        return self._data[i % len(self._data)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args.width, args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    total = args.warmup + args.steps + 1
    n = args.batch * 2 * total
    g = torch.Generator().manual_seed(1)
    data: Any = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))
    if args.samples > n:  # a larger data set over the same tensors (the sampler's permutation grows with it)
        data = Repeated(data, args.samples)
    gc_s = [0.0, 0.0]  # seconds in the collector during the timed steps, and the start of the current collection

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if len(wall) > args.warmup:
            if phase == "start":
                gc_s[1] = time.perf_counter()
            else:
                gc_s[0] += time.perf_counter() - gc_s[1]

    gc.callbacks.append(on_gc)
    wall: list[float] = []
    cpu: list[float] = []
    prof = cProfile.Profile() if args.profile else None

    threads_at: list[dict[str, float]] = []  # each thread's CPU as the timed steps begin and end

    def tick() -> None:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        if len(wall) in (args.warmup + 1, total):
            threads_at.append(thread_cpu())
        if prof is not None and len(wall) == args.warmup + 1:
            prof.enable()

    if args.mode == "plain":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ddp = DDP(model)
        x_all, y_all = data.tensors
        for k in range(total):
            lo = (k * 2 + rank) * args.batch
            x, y = x_all[lo : lo + args.batch], y_all[lo : lo + args.batch]
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            float(loss.detach())
            tick()
    else:
        from elastic import ElasticConfig, ElasticTrainer, LRPolicy, LRRule

        config = ElasticConfig(
            LRPolicy(LRRule.NONE, 1e-4, 2, args.batch),
            None,
            progress_every=0,
            recovery="live" if args.mode == "live" else None,
        )
        trainer = ElasticTrainer(model, optimizer, data, config)
        rank = trainer.rank
        for x, y in trainer.batches(epochs=1):
            trainer.backward(F.mse_loss(trainer.model(x), y))
            tick()  # the previous step is committed when the next batch is asked for: timestamps are one step late
            if len(wall) >= total:
                break
        trainer.close()
    if prof is not None:
        prof.disable()
    if rank == 0:
        steady_w, steady_c = wall[args.warmup :], cpu[args.warmup :]
        result = {
            "mode": args.mode,
            "steps_per_s": (len(steady_w) - 1) / (steady_w[-1] - steady_w[0]),
            "steps_per_cpu_s": (len(steady_c) - 1) / (steady_c[-1] - steady_c[0]),
            "step_ms": [round((b - a) * 1000, 3) for a, b in itertools.pairwise(steady_w)],
            "threads": torch.get_num_threads(),
            "gc_s": round(gc_s[0], 4),
            "thread_cpu_s": cpu_delta(threads_at[0], threads_at[1]) if len(threads_at) == 2 else {},
        }
        Path(args.out).write_text(json.dumps(result))
        if prof is not None:
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            buf.write(f"# {args.mode}: {args.steps} timed steps, rank 0\n## by own time\n")
            stats.sort_stats("tottime").print_stats(30)
            buf.write("## by cumulative time\n")
            stats.sort_stats("cumulative").print_stats(40)
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"{args.mode}.txt").write_text(buf.getvalue())
    if args.mode == "plain":
        dist.barrier()
        dist.destroy_process_group()


def run(mode: str, args: argparse.Namespace, etcd: Any, work: Path, profile: str | None) -> dict[str, Any]:
    from elastic.testing.etcd_server import free_port

    out = work / f"{mode}-{uuid.uuid4().hex[:6]}.json"
    run_id = f"shape-{uuid.uuid4().hex[:6]}"
    if mode == "plain":
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}"]
    else:
        rdzv = ["--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoints}", f"--rdzv-id={run_id}"]
        if mode == "live":
            rdzv.append("--rdzv-conf=recovery=live")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        *rdzv,
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        "--out",
        str(out),
        *(["--profile", profile] if profile else []),
        *[f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "width", "layers", "threads", "samples")],
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    if args.threads:  # OpenMP's pool too, as the benchmark sets it
        env["OMP_NUM_THREADS"] = str(args.threads)
    else:  # as torchrun leaves it with one worker per agent
        env.pop("OMP_NUM_THREADS", None)
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(work / f"{mode}.{i}.log", "ab"))
        for i in range(2)
    ]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{mode}: a torchrun agent exited {p.returncode}: see {work}/{mode}.*.log")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=0, help="the data set's size (default: what the steps take)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--profile", default=None)
    p.add_argument("--out", default=str(HERE / "results" / "live_shape_check.json"))
    args = p.parse_args()
    if args.mode:
        worker(args)
        return
    from elastic.testing.etcd_server import LocalEtcdCluster

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    work = Path(tempfile.mkdtemp(prefix="live-shape-"))
    rounds: list[dict[str, dict[str, Any]]] = []
    with LocalEtcdCluster(1, workdir=work / "etcd") as etcd:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            got = {m: run(m, args, etcd, work, args.profile if r == 0 else None) for m in order}
            rounds.append(got)
            line = "  ".join(f"{m} {got[m]['steps_per_s']:.2f}/s {got[m]['steps_per_cpu_s']:.2f}/cpu-s" for m in modes)
            ratio = (
                f"  live/ddp {got['live']['steps_per_s'] / got['ddp']['steps_per_s']:.3f}"
                if "live" in got and "ddp" in got
                else ""
            )
            print(f"round {r + 1} ({','.join(order)}): {line}{ratio}", flush=True)
    summary: dict[str, Any] = {"shape": {k: getattr(args, k) for k in ("steps", "warmup", "batch", "width", "layers")}}
    summary["threads"] = rounds[0][modes[0]]["threads"]
    for m in modes:
        summary[m] = {
            "steps_per_s": statistics.median(r[m]["steps_per_s"] for r in rounds),
            "steps_per_cpu_s": statistics.median(r[m]["steps_per_cpu_s"] for r in rounds),
        }
    for a, b in (("live", "ddp"), ("live", "plain"), ("ddp", "plain")):
        if a in modes and b in modes:
            per = [r[a]["steps_per_s"] / r[b]["steps_per_s"] for r in rounds]
            per_cpu = [r[a]["steps_per_cpu_s"] / r[b]["steps_per_cpu_s"] for r in rounds]
            summary[f"{a}/{b}"] = {
                "rounds": [round(x, 3) for x in per],
                "median": statistics.median(per),
                "per_cpu_s_median": statistics.median(per_cpu),
            }
            print(
                f"{a}/{b}: median {statistics.median(per):.3f} (rounds {', '.join(f'{x:.2f}' for x in per)}); "
                f"per CPU-s {statistics.median(per_cpu):.3f}"
            )
    summary["raw"] = rounds
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"threads per worker: {summary['threads']}; JSON: {args.out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
