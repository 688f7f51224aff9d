"""A small Lightning job under torchrun for the adapter's tests (tests/integrations/test_lightning.py) and its
benchmark: a tiny, randomly initialised MLP (``LightningModule``) on a synthetic classification set made here, fitted
by ``lightning.Trainer`` with :class:`~elastic.integrations.lightning.ElasticDDPStrategy` (``--plain``: Lightning's
own ``DDPStrategy``, for the benchmark's baseline).

Each rank records one JSON line per committed step in ``--record DIR/rank<R>.<pid>.jsonl``: the step, epoch, world,
the LR applied, the step's samples of this rank as the cursor laid them out (``indices``) and as the
``LightningModule`` trained on them (``seen``: the ids in the batches ``training_step`` got, padding excluded), the
accumulation Lightning ran, the torchrun restart and round. At the end rank 0 writes the loss over the whole data set
(``final.json``) and the parameters (``final_params.pt``).

``--hold-file PATH --hold-epoch E``: from epoch E on, each step waits after its record while PATH exists (a SIGTERM
ends the wait), so that a scenario's kills and joins happen before the job ends, however slow the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.config import ElasticConfig, StepInfo


def make_dataset(n: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(n))


class TinyNet(L.LightningModule):
    """16 -> hidden -> 4 with dropout, SGD with momentum; remembers the ids it trained on (padding excluded)."""

    def __init__(
        self,
        lr: float,
        seed: int,
        dropout: float,
        hidden: int = 32,
        data: TensorDataset | None = None,
        batch: int = 8,
        workers: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4))
        self.lr = lr
        self.data = data
        self.batch = batch
        self.workers = workers
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        if getattr(self.trainer.strategy, "micro_batch_weight", 1.0) > 0:
            self.seen.extend(int(i) for i in ids)
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        assert self.data is not None
        return DataLoader(
            self.data,
            batch_size=self.batch,
            shuffle=True,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-url", default=None)
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-rule", default="fixed-global-batch")
    p.add_argument("--base-world", type=int, default=2)
    p.add_argument("--accum", type=int, default=1, help="the policy's accumulation_steps at the base world")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--workers", type=int, default=0, help="the DataLoader's worker processes")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--hold-file", type=Path, default=None)
    p.add_argument("--hold-epoch", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="Lightning's own DDPStrategy (no adapter, no records)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.record.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}:{os.environ.get('WORLD_SIZE')}"
    data = make_dataset(args.samples)
    model = TinyNet(args.lr, args.seed, args.dropout, args.hidden, data, args.batch, args.workers)
    log: list[Path] = []

    def on_step(info: StepInfo) -> None:
        trainer = model.trainer
        record = {
            "step": info.step,
            "epoch": info.epoch,
            "rank": info.rank,
            "world": info.world_size,
            "lr": info.lr,
            "loss": info.loss,
            "indices": list(info.indices),
            "seen": model.seen,
            "accumulation": trainer.accumulate_grad_batches,
            "restart": restart,
            "attempt": attempt,
            "t": time.time(),
            "pid": os.getpid(),
        }
        model.seen = []
        if not log:
            log.append(args.record / f"rank{info.rank}.{os.getpid()}.jsonl")
        with open(log[0], "a") as f:
            f.write(json.dumps(record) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.hold_file is not None and info.epoch >= args.hold_epoch:
            while args.hold_file.exists() and not model.trainer.strategy.preemption_requested:
                time.sleep(0.05)

    if args.plain:
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy()
        devices, nodes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("WORLD_SIZE", "1"))
        nodes //= devices
    else:
        from elastic.integrations.lightning import ElasticDDPStrategy

        policy = LRPolicy(
            LRRule(args.lr_rule),
            args.lr,
            args.base_world,
            args.batch,
            warmup_steps=args.warmup,
            accumulation_steps=args.accum,
        )
        config = ElasticConfig(
            policy, args.checkpoint_url, save_every_steps=args.save_every or None, seed=args.seed, progress_every=0
        )
        strategy = ElasticDDPStrategy(config, on_step=on_step)
        devices, nodes = 1, 1
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    trainer.fit(model)
    elapsed = time.perf_counter() - started
    if trainer.global_rank == 0:
        model.eval()
        with torch.no_grad():
            x, y, _ = data.tensors
            loss = float(F.cross_entropy(model(x), y))
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(params, args.record / "final_params.pt")
        (args.record / "final.json").write_text(
            json.dumps({"loss": loss, "step": trainer.global_step, "fit_seconds": elapsed})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
