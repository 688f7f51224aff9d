"""A tiny character-level transformer on examples/data/tiny_shakespeare.txt, elastic.

    torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \
        --rdzv-id=chargpt examples/elastic_chargpt.py --checkpoint-url /tmp/ckpt/chargpt
"""

import argparse
import logging

import torch
import torch.nn.functional as F
from common import DATA, CharDataset, TinyTransformer, setup_logging

from elastic.contract.lr import LRPolicy
from elastic.train.trainer import ElasticConfig, ElasticTrainer

log = logging.getLogger("chargpt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-rule", default="sqrt")
    parser.add_argument("--base-world", type=int, default=2)
    parser.add_argument("--checkpoint-url", default=None)
    parser.add_argument("--text", default=str(DATA / "tiny_shakespeare.txt"))
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    dataset = CharDataset(__import__("pathlib").Path(args.text))
    model = TinyTransformer(len(dataset.chars))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(dataset) // args.batch)
    policy = LRPolicy(args.lr_rule, args.lr, args.base_world, args.batch, warmup_steps=20)
    config = ElasticConfig(policy, args.checkpoint_url, save_every_steps=100, progress_every=20)
    trainer = ElasticTrainer(model, optimizer, dataset, config, scheduler=scheduler)
    for x, y in trainer.batches(epochs=args.epochs):
        logits = trainer.model(x)
        trainer.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    log.info("done at step %d", trainer.step)
    trainer.close()


if __name__ == "__main__":
    main()
