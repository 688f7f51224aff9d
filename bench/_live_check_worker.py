"""The worker of ``bench/gpu_live_check.py``: an MLP trained by :class:`ElasticTrainer` in live recovery mode.

Run under torchrun (``--rdzv-conf recovery=live``). ``--device cuda`` trains on the local GPU over NCCL,
``--device cpu`` over gloo. Every committed step appends one JSON line to ``--record DIR/rank<R>.<pid>.jsonl``
(step, generation, late, pid, time, world, device, backend); at the end the worker writes
``final.rank<R>.<pid>.json`` (its last step, device, backend).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic.contract.lr import LRPolicy, LRRule
from elastic.interpreter import freeze_at_exit
from elastic.train.trainer import ElasticConfig, ElasticTrainer, LiveOptions, RecoveryMode, StepInfo

FEATURES, CLASSES = 64, 8


def make_dataset(n: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint-url", required=True)
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.02)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.record.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(), nn.Linear(args.hidden, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ElasticConfig(
        LRPolicy(LRRule.NONE, 1e-3, 1, args.batch),
        args.checkpoint_url,
        save_every_steps=args.save_every,
        backend="nccl" if args.device == "cuda" else "gloo",
        progress_every=0,
        recovery=RecoveryMode.LIVE,
        live=LiveOptions(ttl=timedelta(seconds=2)),
    )
    records: list[Path] = []
    fields: dict[str, str] = {}

    def on_step(info: StepInfo) -> None:
        record = {
            "step": info.step,
            "gen": info.generation,
            "late": info.late,
            "pid": os.getpid(),
            "t": time.time(),
            "world": info.world_size,
            **fields,
        }
        with open(records[0], "a") as f:
            f.write(json.dumps(record) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)

    trainer = ElasticTrainer(model, optimizer, make_dataset(args.samples), config, on_step=on_step)
    records.append(args.record / f"rank{trainer.rank}.{os.getpid()}.jsonl")
    fields.update(device=str(trainer.device), backend=str(dist.get_backend()))
    for x, y in trainer.batches(epochs=args.epochs):
        trainer.backward(F.cross_entropy(trainer.model(x), y))
    done = {"step": trainer.step, "pid": os.getpid(), **fields}
    (args.record / f"final.rank{trainer.rank}.{os.getpid()}.json").write_text(json.dumps(done))
    trainer.close()
    return 0


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    sys.exit(main())
