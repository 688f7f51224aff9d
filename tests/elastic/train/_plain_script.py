"""A user's ``train.py``, run as ``python _plain_script.py URL STEPS MODE`` (no torchrun): a few steps of the
ElasticTrainer with durable snapshots at URL, printing ``start step N`` (the step it resumed from) and
``end step N`` to stdout. The script configures no logging, except in the modes that say so:

- ``plain``: nothing configured;
- ``basic-after``: ``logging.basicConfig`` with a format of its own (``USER ...``) after the trainer is built;
- ``twice``: two trainers one after the other (each trains STEPS steps), nothing configured;
- ``slow``: 50 ms of sleep after each step (a worker to SIGKILL while it writes node-local snapshots).
"""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic.contract.lr import LRPolicy, LRRule
from elastic.interpreter import freeze_at_exit
from elastic.train.trainer import ElasticConfig, ElasticTrainer


def _train(url: str, steps: int, mode: str) -> None:
    torch.manual_seed(0)
    n = 25600 if mode == "slow" else 256  # slow: an epoch of 3200 steps, minutes, ended by its test
    dataset = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = LRPolicy(LRRule.NONE, 0.1, base_world_size=1, base_batch_per_worker=8)
    trainer = ElasticTrainer(
        model, optimizer, dataset, ElasticConfig(policy, checkpoint_url=url, save_every_steps=2, progress_every=1)
    )
    if mode == "basic-after":
        logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
    print(f"start step {trainer.step}", flush=True)
    target = trainer.step + steps
    for x, y in trainer.batches(0):
        trainer.backward(F.mse_loss(trainer.model(x), y))
        if mode == "slow":
            time.sleep(0.05)
        if trainer.step >= target:
            break
    trainer.close()
    print(f"end step {trainer.step}", flush=True)


def main() -> None:
    url, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    for _ in range(2 if mode == "twice" else 1):
        _train(url, steps, mode)


if __name__ == "__main__":
    freeze_at_exit()
    main()
