"""Digits classifier with plain DDP, the tutorial way (the baseline that elastic_digits.py changes).

torchrun --nproc-per-node=2 examples/ddp_digits.py
"""

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import digits_dataset, digits_model, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

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
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        log.info("epoch %d loss %.4f", epoch, loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
