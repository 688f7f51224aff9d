"""An image classifier with plain DDP (the baseline that elastic_images.py changes): small synthetic RGB images,
augmented (random flips and crops) in the DataLoader's 2 worker processes, pinned memory, persistent workers.

    torchrun --nproc-per-node=2 examples/ddp_images.py
"""

import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import AugmentedImages, classifier_loss, image_model, log_final, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

log = logging.getLogger("images")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    train = AugmentedImages(args.samples, seed=args.seed)
    val = AugmentedImages(512, seed=args.seed + 1, augment=False)
    model = image_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    ddp_model = DDP(model)
    workers = {"num_workers": args.workers, "pin_memory": True, "persistent_workers": args.workers > 0}
    sampler = DistributedSampler(train, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, **workers)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train.set_epoch(epoch)  # the augmentation's seed (see AugmentedImages)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            log.info("epoch %d: val loss %.4f", epoch, classifier_loss(model, val, device))
    if dist.get_rank() == 0:
        log_final(classifier_loss(model, val, device))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
