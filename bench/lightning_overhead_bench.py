"""The Lightning adapter's overhead (issue 51): the step rate of ``lightning.Trainer.fit`` with
``ElasticDDPStrategy`` (elastic/integrations/lightning.py) against the same ``Trainer`` with Lightning's own
``DDPStrategy``, side by side in one run, interleaved rounds, no snapshots (no checkpoint storage at all). Goal: >= 0.98
of the plain Trainer's rate.

One run of stock torchrun (``--standalone``, ``--nproc-per-node`` ranks, gloo on CPU) of this file in ``--worker`` mode
fits the same model ``--rounds`` times with each strategy, in alternating order, in the same processes (a fresh
``Trainer`` and model each time): an MLP (256 -> ``--hidden`` -> ``--hidden`` -> 10, randomly initialised; 2048: a step
of ~40 ms of CPU) on random data made in the worker, a per-rank batch of 32 from a shuffled ``DataLoader`` (Lightning's
``DistributedSampler`` in the plain run, the elastic batch sampler in the other), SGD with momentum, no logger, no
progress bar, no checkpointing; the first ``--warmup`` steps of each fit are not timed. What the adapter adds per step:
the rebuilt ``DataLoader`` over the elastic batch sampler, the lockstep check of each micro-batch, its loss weight, the
LR factor around ``optimizer.step()``, the cursor's commit and the boundary's flags (one small all-reduce). Rank 0 times
every step; a fit's figure is its median step (wall, and CPU of rank 0), robust to bursts of other load on a shared
machine; the ratio is the median over rounds of plain's median step / elastic's (the step rate's ratio).

    python bench/lightning_overhead_bench.py [--rounds 6] [--steps 150] [--nproc 2] [--hidden 2048] \\
        [--out bench/results/lightning_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH, LR = 32, 0.01


def worker(out: Path, rounds: int, steps: int, warmup: int, hidden: int) -> None:
    """Under torchrun: ``rounds`` pairs of fits in these processes, plain and elastic in alternating order, each
    ``warmup + steps`` optimizer steps; rank 0 times the last ``steps`` of each, step by step."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from elastic.contract.lr import LRPolicy
    from elastic.integrations.lightning import ElasticDDPStrategy

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = warmup + steps
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(total * BATCH * world, 256, generator=g),
        torch.randint(0, 10, (total * BATCH * world,), generator=g),
    )

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step >= warmup:
                self.wall.append(time.perf_counter())
                self.cpu.append(time.process_time())

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(data, batch_size=BATCH, shuffle=True)

    def fit(system: str) -> dict[str, float]:
        strategy: Any = ElasticDDPStrategy(LRPolicy("none", LR, world, BATCH)) if system == "elastic" else DDPStrategy()
        timer = Timer()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=local,
            num_nodes=world // local,
            strategy=strategy,
            max_steps=total,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[timer],
        )
        trainer.fit(MLP())
        wall = [b - a for a, b in zip(timer.wall, timer.wall[1:], strict=False)]
        cpu = [b - a for a, b in zip(timer.cpu, timer.cpu[1:], strict=False)]
        seconds, cpu_seconds = timer.wall[-1] - timer.wall[0], timer.cpu[-1] - timer.cpu[0]
        return {
            "steps": len(wall),
            "seconds": seconds,
            "median_step_s": statistics.median(wall),
            "median_step_cpu_s": statistics.median(cpu),
            "steps_per_s": len(wall) / seconds,
            "steps_per_cpu_s": len(wall) / cpu_seconds,
        }

    results = []
    for r in range(rounds):
        order = ["plain", "elastic"] if r % 2 == 0 else ["elastic", "plain"]
        res = {system: fit(system) for system in order}
        results.append(res)
        if int(os.environ.get("RANK", "0")) == 0:
            p, e = res["plain"], res["elastic"]
            print(
                f"round {r + 1}: median step plain {1e3 * p['median_step_s']:.2f} ms "
                f"({1e3 * p['median_step_cpu_s']:.2f} ms CPU), elastic {1e3 * e['median_step_s']:.2f} ms "
                f"({1e3 * e['median_step_cpu_s']:.2f} ms CPU); elastic / plain step rate "
                f"{p['median_step_s'] / e['median_step_s']:.3f} wall, "
                f"{p['median_step_cpu_s'] / e['median_step_cpu_s']:.3f} CPU",
                flush=True,
            )
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048, help="the MLP's width (the step's cost)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lightning_overhead.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.out, args.rounds, args.steps, args.warmup, args.hidden)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rounds.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            __file__,
            "--worker",
            "--out",
            str(raw),
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--hidden",
            str(args.hidden),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        env.pop("ETRAIN_CHECKPOINT_URL", None)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        print(done.stdout, end="")
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-4000:]}")
        rounds = json.loads(raw.read_text())
    for r in rounds:
        r["ratio_wall"] = r["plain"]["median_step_s"] / r["elastic"]["median_step_s"]
        r["ratio_cpu"] = r["plain"]["median_step_cpu_s"] / r["elastic"]["median_step_cpu_s"]
    ratio = statistics.median(r["ratio_wall"] for r in rounds)
    ratio_cpu = statistics.median(r["ratio_cpu"] for r in rounds)
    import lightning
    import torch

    summary = {
        "bench": "lightning_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "nproc": args.nproc,
        "hidden": args.hidden,
        "steps_timed": args.steps,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "rounds": rounds,
        "median_ratio_wall": ratio,
        "median_ratio_cpu": ratio_cpu,
        "goal": 0.98,
        "met": ratio >= 0.98,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(
        f"median over rounds of elastic / plain step rate (each fit's median step): {ratio:.3f} wall, "
        f"{ratio_cpu:.3f} CPU; goal 0.98: {'met' if ratio >= 0.98 else 'missed'}; {args.out}"
    )


if __name__ == "__main__":
    main()
