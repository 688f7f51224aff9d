"""A GAN on 2-D points with plain DDP (the baseline that elastic_gan.py changes): two optimizers over one
DDP-wrapped module (common.GAN) that returns the discriminator's and the generator's losses for one backward.

    torchrun --nproc-per-node=2 examples/ddp_gan.py
"""

import argparse
import logging
import os

import torch
import torch.distributed as dist
from common import GAN, gan_loss, log_final, ring_points, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

log = logging.getLogger("gan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    data = ring_points(args.samples, seed=args.seed)
    model = GAN().to(device)
    opt_d = torch.optim.Adam(model.d.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(model.g.parameters(), lr=args.lr, betas=(0.5, 0.9))
    ddp_model = DDP(model)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=args.seed))
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for real, z in loader:
            opt_d.zero_grad(set_to_none=True)
            opt_g.zero_grad(set_to_none=True)
            d_loss, g_loss = ddp_model(real.to(device), z.to(device))
            (d_loss + g_loss).backward()  # D's loss reaches only D, G's only G (see common.GAN)
            opt_d.step()
            opt_g.step()
        if dist.get_rank() == 0:
            log.info("epoch %d: D + G loss %.4f", epoch, gan_loss(model, data))
    if dist.get_rank() == 0:
        log_final(gan_loss(model, data))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
