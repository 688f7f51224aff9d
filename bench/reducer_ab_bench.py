"""Live mode's gradient all-reduce against torch's DDP inside one 2-rank job, blocks of steps interleaved: where the
live step's time goes without the run-to-run noise of separate jobs (issue 52).

The same model (issue 52's shape by default: a 4-layer 1024-wide MLP, 64 samples per rank, SGD, MSE; ``--batch 16
--optimizer adamw``: the loop benchmark's defaults) in several
copies of identical weights, one per variant, each stepped in turn for ``--block`` steps, ``--blocks`` times:

- ``ddp``: ``DistributedDataParallel`` (its C++ reducer);
- ``reducer``: :class:`~elastic.live.grads.LiveDataParallel` + :class:`~elastic.live.grads.GradientReducer` (the
  buckets all-reduced as the backward pass produces them, waited after it);
- ``reducer+commit``: the same, plus the live loop's commit point: a flags all-reduce after the optimizer step
  (``ImmediateAgreement``'s collective, 3 int64s);
- ``ddp+commit``: DDP plus the same flags all-reduce (what the commit point alone costs).

Per variant: the median step time (ms) and CPU ms per step over all its blocks, and the ratios to ``ddp``. Run under
torchrun, or alone (it starts ``torchrun --standalone --nproc-per-node 2`` on itself). JSON to ``--out`` (default
``bench/results/reducer_ab.json``).

    python bench/reducer_ab_bench.py [--blocks 30] [--block 10] [--width 1024] [--layers 4] [--batch 64] \
        [--optimizer sgd|adamw]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("ddp", "reducer", "reducer+commit", "ddp+commit")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic.live.grads import GradientReducer, LiveDataParallel

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(args.layers):
        layers += [nn.Linear(args.width, args.width)] + ([nn.ReLU()] if i < args.layers - 1 else [])
    base = nn.Sequential(*layers)
    variants = [v for v in args.variants.split(",") if v]
    models: dict[str, Any] = {}
    reducers: dict[str, Any] = {}
    for v in variants:
        m = copy.deepcopy(base)
        if v.startswith("ddp"):
            models[v] = DDP(m)
        else:
            reducers[v] = GradientReducer(m)
            models[v] = LiveDataParallel(m, reducers[v])
    make = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    opts = {v: make(models[v].parameters(), lr=1e-4) for v in variants}
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    flags = torch.zeros(3, dtype=torch.int64)
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}

    def step(v: str) -> None:
        opt = opts[v]
        opt.zero_grad()
        loss = F.mse_loss(models[v](x), y)
        loss.backward()
        if v in reducers:
            reducers[v].finish(world)
        opt.step()
        if v.endswith("+commit"):
            dist.all_reduce(flags)
        float(loss.detach())

    for v in variants:  # warm-up: DDP's first iterations rebuild its buckets
        for _ in range(5):
            step(v)
    for b in range(args.blocks):
        order = variants if b % 2 == 0 else variants[::-1]
        for v in order:
            dist.barrier()
            for _ in range(args.block):
                t0, c0 = time.perf_counter(), time.thread_time()
                step(v)
                wall[v].append(time.perf_counter() - t0)
                cpu[v].append(time.thread_time() - c0)
    if rank == 0:
        ref = statistics.median(wall["ddp"]) if "ddp" in wall else None
        ref_cpu = statistics.median(cpu["ddp"]) if "ddp" in cpu else None
        result: dict[str, Any] = {"shape": vars(args) | {"world": world}}
        for v in variants:
            ms, cms = statistics.median(wall[v]) * 1e3, statistics.median(cpu[v]) * 1e3
            result[v] = {"median_ms": ms, "cpu_ms": cms, "mean_ms": statistics.mean(wall[v]) * 1e3}
            rel = f"  rate vs ddp {ref * 1e3 / ms:.3f}, cpu vs ddp {ref_cpu * 1e3 / cms:.3f}" if ref and ref_cpu else ""
            print(f"{v:>16}: median {ms:6.2f} ms/step, main-thread CPU {cms:6.2f} ms/step{rel}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(HERE / "results" / "reducer_ab.json"))
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
