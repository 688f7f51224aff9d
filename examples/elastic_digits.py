"""Digits classifier, elastic: survives node loss, resizes, preemption. It is ddp_digits.py with the
distributed data loading and the optimizer step handed to the ElasticTrainer (diff the two files).

    ETRAIN_CHECKPOINT_URL=/tmp/ckpt/digits torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=1 \
        --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=digits examples/elastic_digits.py
"""

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import digits_dataset, digits_model, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic import ElasticConfig, ElasticTrainer, LRPolicy

log = logging.getLogger("digits")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_logging()
    dist.init_process_group("gloo")
    dataset = digits_dataset()
    model = digits_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model = DDP(model)
    policy = LRPolicy("linear", args.lr, base_world_size=2, base_batch_per_worker=args.batch, warmup_steps=10)
    trainer = ElasticTrainer(model, optimizer, dataset, ElasticConfig(policy, seed=args.seed))
    for epoch in range(args.epochs):
        for x, y in trainer.batches(epoch):
            loss = F.cross_entropy(model(x), y)
            trainer.backward(loss)
        log.info("epoch %d done at step %d", epoch, trainer.step)
    trainer.close()


if __name__ == "__main__":
    main()
