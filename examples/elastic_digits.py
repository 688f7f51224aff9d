"""Digits classifier, elastic: survives node loss, resizes, preemption (compare with ddp_digits.py).

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \
        --rdzv-id=digits examples/elastic_digits.py --checkpoint-url /tmp/ckpt/digits
"""

import argparse
import logging

import torch
import torch.nn.functional as F
from common import digits_dataset, digits_model, setup_logging

from elastic.loop import ElasticConfig, ElasticTrainer
from elastic.lr import LRPolicy

log = logging.getLogger("digits")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-rule", default="linear")
    parser.add_argument("--base-world", type=int, default=2)
    parser.add_argument("--checkpoint-url", default=None)
    args = parser.parse_args()
    setup_logging()
    dataset = digits_dataset()
    model = digits_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    policy = LRPolicy(args.lr_rule, args.lr, args.base_world, args.batch, warmup_steps=10)
    trainer = ElasticTrainer(model, optimizer, dataset, ElasticConfig(policy, args.checkpoint_url, seed=args.seed))
    for x, y in trainer.batches(epochs=args.epochs):
        loss = F.cross_entropy(trainer.model(x), y)
        trainer.backward(loss)
    log.info("done at step %d, final loss %.4f", trainer.step, loss.item())
    trainer.close()


if __name__ == "__main__":
    main()
