"""A GAN on 2-D points, elastic: ddp_gan.py with the loop's own-step form (diff the two files). The script steps
its two optimizers itself; the loop applies the LR policy's factor around each one's step, saves both (the second
as registered state), and commits the step once every worker stepped both.

    ETRAIN_CHECKPOINT_URL=/tmp/ckpt/gan torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=1 \\
        --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=gan examples/elastic_gan.py
"""

import argparse
import logging
import os

import torch
import torch.distributed as dist
from common import GAN, gan_loss, log_final, record_steps, ring_points, setup_logging

from elastic import ElasticConfig, ElasticTrainer, LRPolicy

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
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    data = ring_points(args.samples, seed=args.seed)
    model = GAN().to(device)
    opt_d = torch.optim.Adam(model.d.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(model.g.parameters(), lr=args.lr, betas=(0.5, 0.9))
    config = ElasticConfig(LRPolicy("fixed-global-batch", args.lr, 2, args.batch), save_every_steps=10, seed=args.seed)
    trainer = ElasticTrainer(model, [opt_d, opt_g], data, config, on_step=record_steps())
    for epoch in range(args.epochs):
        for step in trainer.steps(epoch):
            opt_d.zero_grad(set_to_none=True)
            opt_g.zero_grad(set_to_none=True)
            for real, z in step:
                d_loss, g_loss = trainer.model(real.to(device), z.to(device))
                step.backward(d_loss + g_loss)  # D's loss reaches only D, G's only G (see common.GAN)
            opt_d.step()
            opt_g.step()
        if dist.get_rank() == 0:
            log.info("epoch %d: D + G loss %.4f", epoch, gan_loss(model, data))
    if dist.get_rank() == 0:
        log_final(gan_loss(model, data))
    trainer.close()


if __name__ == "__main__":
    main()
