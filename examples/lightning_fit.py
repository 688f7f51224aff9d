"""A plain PyTorch Lightning script plus the one elastic line (docs/integrations.md).

A small CNN learns scikit-learn's bundled 8x8 digits (nothing downloaded). Without the ``strategy=`` line it is the
``LightningModule`` + ``Trainer.fit`` of the Lightning tutorials; with it, under torchrun on the etcd-v3 rendezvous,
nodes may come and go:

    torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=etcd-v3 \\
        --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=pl1 -m elastic.prefork examples/lightning_fit.py \\
        --checkpoint-url ckpt/pl

or ``python examples/lightning_fit.py`` (a world of one). Every sample is seen once per epoch whatever the number of
workers, the global batch of 2 workers x 32 is kept (a world of 1 accumulates 2 micro-batches of 32, one of 4 takes
16 per worker), snapshots go to ``--checkpoint-url`` (any fsspec URL: a path, ``s3://...``) every 50 steps and on
SIGTERM, and a restarted run resumes from the newest verified one by itself (``Trainer.fit`` needs no
``ckpt_path``).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from common import digits_dataset, digits_model
from torch.utils.data import DataLoader

from elastic import LRPolicy
from elastic.integrations.lightning import ElasticDDPStrategy


class Digits(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = digits_model()
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-url", default=os.environ.get("ETRAIN_CHECKPOINT_URL", "ckpt/lightning_fit"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    data = DataLoader(digits_dataset(), batch_size=args.batch, shuffle=True)
    policy = LRPolicy("fixed-global-batch", args.lr, base_world_size=2, base_batch_per_worker=args.batch)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,  # Lightning's own .ckpt files may stay on: the elastic snapshots are separate
        enable_progress_bar=False,
        strategy=ElasticDDPStrategy(policy, args.checkpoint_url),  # the one elastic line (plain: strategy="ddp")
    )
    trainer.fit(Digits(args.lr), data)
    if trainer.is_global_zero:
        print(
            json.dumps(
                {
                    "step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                    "loss": float(trainer.callback_metrics["loss"]),
                }
            )
        )


if __name__ == "__main__":
    main()
