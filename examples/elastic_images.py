"""An image classifier, elastic: ddp_images.py with the data split and the optimizer step handed to the loop
(diff the two files). The process group and the DDP wrapper stay the script's own (restart recovery: torchrun
restarts the workers from the last snapshot), and so does the DataLoader (2 workers augmenting, pinned memory,
persistent workers); its batch sampler is the loop's, which serves each step's samples exactly once across kills and
resizes.

    ETRAIN_CHECKPOINT_URL=/tmp/ckpt/images torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=1 \\
        --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=images examples/elastic_images.py
"""

import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import AugmentedImages, classifier_loss, image_model, log_final, record_steps, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from elastic import ElasticBatchSampler, ElasticConfig, ElasticTrainer, LRPolicy

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
    config = ElasticConfig(LRPolicy("fixed-global-batch", args.lr, 2, args.batch), save_every_steps=10)
    workers = {"num_workers": args.workers, "pin_memory": True, "persistent_workers": args.workers > 0}
    sampler = ElasticBatchSampler(train, seed=args.seed)
    loader = DataLoader(train, batch_sampler=sampler, **workers)
    trainer = ElasticTrainer(ddp_model, optimizer, loader, config, on_step=record_steps())
    for epoch in range(args.epochs):
        train.set_epoch(epoch)  # the augmentation's seed (see AugmentedImages)
        for x, y in trainer.batches(epoch):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp_model(x), y)
            trainer.backward(loss)
        if dist.get_rank() == 0:
            log.info("epoch %d: val loss %.4f", epoch, classifier_loss(model, val, device))
    if dist.get_rank() == 0:
        log_final(classifier_loss(model, val, device))
    trainer.close()


if __name__ == "__main__":
    main()
