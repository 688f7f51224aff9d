"""Worker for loop_overhead_bench.py: the char transformer trained by plain DDP or by the ElasticTrainer."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import DATA, CharDataset, TinyTransformer

from elastic import ElasticConfig, ElasticTrainer, LRPolicy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "elastic"], required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint-url", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()  # ElasticTrainer.close() leaves the process group: remember who writes
    dataset = CharDataset(DATA / "tiny_shakespeare.txt")
    model = DDP(TinyTransformer(len(dataset.chars)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times: list[float] = []

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if args.mode == "plain":
        sampler = DistributedSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
        epoch = 0
        while len(times) < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss_of(x, y).backward()
                optimizer.step()
                times.append(time.perf_counter())
                if len(times) >= args.steps:
                    break
            epoch += 1
    else:
        policy = LRPolicy("linear", 1e-3, dist.get_world_size(), args.batch)
        config = ElasticConfig(policy, args.checkpoint_url, save_every_steps=25, progress_every=0)
        trainer = ElasticTrainer(model, optimizer, dataset, config)
        for x, y in trainer.batches(epochs=100):
            trainer.backward(loss_of(x, y))
            if len(times) < trainer.step:  # one optimizer step completed inside batches()
                times.append(time.perf_counter())
            if trainer.step >= args.steps:
                break
        trainer.close()
    if rank == 0:
        steady = times[args.warmup :]
        rate = (len(steady) - 1) / (steady[-1] - steady[0])
        args.out.write_text(json.dumps({"mode": args.mode, "steps_per_s": rate, "steps": len(times)}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
