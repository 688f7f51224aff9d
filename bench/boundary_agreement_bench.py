"""The boundary's agreement at every boundary (ImmediateAgreement), overlapped with the next step at every boundary
(DeferredAgreement with a zero interval: what DDP in restart mode did until 2026-12-06) and overlapped every few
boundaries (DeferredAgreement's default ``interval``: what DDP in restart mode uses, elastic/train/agreement.py),
inside one job: 2 ranks under ``torchrun --standalone``, the char transformer fed by a 2-worker DataLoader over an
ElasticBatchSampler (the loop's short form), the agreements swapped every ``--block`` steps at the same step on both
ranks (``--blocks`` blocks, in turn), so that all see the same machine. Prints each block's steps/s (rank 0, wall
and per CPU-second) and the medians, and writes JSON. A bench, not a test: it swaps the trainer's private agreement
object between blocks.

    python bench/boundary_agreement_bench.py [--block 150] [--blocks 9] [--json bench/results/boundary_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE.parent / "examples"))
    import torch
    import torch.nn.functional as F
    from common import DATA, CharDataset, TinyTransformer
    from torch.utils.data import DataLoader

    from elastic import ElasticConfig, ElasticTrainer, LRPolicy
    from elastic.train.agreement import DeferredAgreement, ImmediateAgreement
    from elastic.train.batch_sampler import ElasticBatchSampler

    torch.manual_seed(0)
    dataset = CharDataset(DATA / "tiny_shakespeare.txt")
    model = TinyTransformer(len(dataset.chars))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_sampler=ElasticBatchSampler(dataset), num_workers=2, persistent_workers=True)
    config = ElasticConfig(LRPolicy("linear", 1e-3, 2, 16), None, progress_every=0)
    trainer = ElasticTrainer(model, optimizer, loader, config)
    host = trainer._host
    make = {
        "windowed": DeferredAgreement,
        "every-step": lambda device, group: DeferredAgreement(device, group, timedelta(0)),
        "immediate": ImmediateAgreement,
    }
    names = list(make)
    order = [names[i % len(names)] for i in range(args.blocks)]
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in make}
    warmup, k, block, current = 30, 0, 0, order[0]
    trainer._agreement = make[current](host.device, host.group)
    t0 = c0 = 0.0
    for x, y in trainer.batches(epochs=1000):
        logits = trainer.model(x)
        trainer.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        k += 1
        if k == warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        elif k > warmup and (k - warmup) % args.block == 0:
            t1, c1 = time.perf_counter(), time.process_time()
            rates[current].append((args.block / (t1 - t0), args.block / (c1 - c0)))
            block += 1
            if block == len(order):
                break
            trainer._agreement.drain()  # what is in flight is waited for on both ranks, then the swap
            current = order[block]
            trainer._agreement = make[current](host.device, host.group)
            t0, c0 = time.perf_counter(), time.process_time()
    if trainer.rank == 0:
        out = {
            name: {"steps_per_s": [w for w, _ in r], "steps_per_cpu_s": [c for _, c in r]} for name, r in rates.items()
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"block": args.block, "blocks": args.blocks, **out}, indent=2))
    trainer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", type=int, default=150, help="steps per block")
    p.add_argument("--blocks", type=int, default=9, help="blocks, windowed, every-step and immediate in turn")
    p.add_argument("--json", default=str(HERE / "results" / "boundary_agreement.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    load = os.getloadavg()[0]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--worker",
        "--block",
        str(args.block),
        "--blocks",
        str(args.blocks),
        "--json",
        args.json,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(Path(args.json).read_text())
    print(
        f"{os.cpu_count()} CPU(s), load average {load:.2f} at start; 2 ranks, char transformer, 2-worker DataLoader, "
        f"{args.blocks} blocks of {args.block} steps in turn"
    )
    medians = {}
    for name in ("windowed", "every-step", "immediate"):
        wall, cpu = result[name]["steps_per_s"], result[name]["steps_per_cpu_s"]
        medians[name] = statistics.median(wall)
        print(
            f"{name:9s} wall {[round(w, 2) for w in wall]} median {medians[name]:.2f} steps/s, "
            f"per CPU-second median {statistics.median(cpu):.2f}"
        )
    print(f"windowed / every-step: {medians['windowed'] / medians['every-step']:.3f}")
    print(f"windowed / immediate: {medians['windowed'] / medians['immediate']:.3f}")
    result["load_average_start"] = load
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
