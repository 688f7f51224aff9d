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
    p.add_argument("--save-every", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()  # ElasticTrainer.close() leaves the process group: remember who writes
    dataset = CharDataset(DATA / "tiny_shakespeare.txt")
    model = DDP(TinyTransformer(len(dataset.chars)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times: list[float] = []
    cpu: list[float] = []

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
                if args.checkpoint_url and (len(times) + 1) % args.save_every == 0 and rank == 0:
                    # the tutorial way: a synchronous torch.save from rank 0, then move on
                    Path(args.checkpoint_url).mkdir(parents=True, exist_ok=True)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                    torch.save(state, Path(args.checkpoint_url) / "latest.pt")
                times.append(time.perf_counter())
                cpu.append(time.process_time())
                if len(times) >= args.steps:
                    break
            epoch += 1
    else:
        policy = LRPolicy("linear", 1e-3, dist.get_world_size(), args.batch)
        config = ElasticConfig(policy, args.checkpoint_url, save_every_steps=args.save_every, progress_every=0)
        trainer = ElasticTrainer(model, optimizer, dataset, config)
        for x, y in trainer.batches(epochs=100):
            trainer.backward(loss_of(x, y))
            if len(times) < trainer.step:  # one optimizer step completed inside batches()
                times.append(time.perf_counter())
                cpu.append(time.process_time())
            if trainer.step >= args.steps:
                break
        trainer.close()
    if rank == 0:
        steady = times[args.warmup :]
        rate = (len(steady) - 1) / (steady[-1] - steady[0])
        cpu_steady = cpu[args.warmup :]
        cpu_rate = (len(cpu_steady) - 1) / (cpu_steady[-1] - cpu_steady[0])  # steps per CPU-second of rank 0
        args.out.write_text(
            json.dumps({"mode": args.mode, "steps_per_s": rate, "steps_per_cpu_s": cpu_rate, "steps": len(times)})
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
