"""A character-level GPT, nanoGPT style, elastic: ddp_nanogpt.py with the loop's own-step form (diff the two files).
The script keeps its step: autocast, the GradScaler, clipping, the cosine LR it sets at every iteration, the EMA and
the evaluations are its own. The loop hands it each step's micro-batches (random windows drawn with replacement,
each draw consumed once whatever the resizes), splits the accumulation over the workers there are (the global batch
stays that of 2 workers), and saves the EMA and the GradScaler with the rest of the state at each evaluation.

    ETRAIN_CHECKPOINT_URL=/tmp/ckpt/nanogpt torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=1 \
        --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=nanogpt examples/elastic_nanogpt.py

(``--rdzv-conf recovery=live`` recovers from a lost worker without restarting the others.)
"""

import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import DATA, CharDataset, TinyTransformer, lm_loss, log_final, record_steps, setup_logging
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from elastic import ElasticBatchSampler, ElasticConfig, ElasticTrainer, LRPolicy

log = logging.getLogger("nanogpt")


def cosine_lr(it: int, args: argparse.Namespace) -> float:
    """The LR of iteration ``it`` (from 1): a linear warmup, then a cosine decay to ``min_lr``."""
    if it <= args.warmup_iters:
        return args.lr * it / args.warmup_iters
    progress = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-iters", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="windows per worker and micro-step")
    parser.add_argument("--accum", type=int, default=2, help="micro-steps per iteration (gradient accumulation)")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup-iters", type=int, default=20)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.95)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + int(os.environ.get("RANK", "0")))
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device_type == "cuda" else "cpu")
    dtype = torch.bfloat16 if device_type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    ctx = torch.autocast(device_type, dtype=dtype)
    train = CharDataset(DATA / "tiny_shakespeare.txt", args.block, split="train")
    val = CharDataset(DATA / "tiny_shakespeare.txt", args.block, split="val")
    model = TinyTransformer(len(train.chars), args.block, width=32, dropout=0.0).to(device)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)  # a no-op object unless fp16
    policy = LRPolicy("fixed-global-batch", args.lr, 2, args.batch, accumulation_steps=args.accum)
    config = ElasticConfig(policy, save_every_steps=args.eval_interval)  # a snapshot at each evaluation
    data = torch.utils.data.DataLoader(train, batch_sampler=ElasticBatchSampler(train, replacement=True))
    trainer = ElasticTrainer(model, optimizer, data, config, state=dict(ema=ema, scaler=scaler), on_step=record_steps())
    for step in trainer.steps(max_steps=args.max_iters):
        it = step.index
        lr = cosine_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for x, y in step:
            with ctx:
                logits = trainer.model(x.to(device))
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
            step.backward(loss, scaler)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        if it % args.eval_interval == 0 and dist.get_rank() == 0:
            log.info(
                "iter %d: loss %.4f, val %.4f, val of the EMA %.4f, lr %.2e",
                it,
                loss.item(),
                lm_loss(model, val, ctx, device),
                lm_loss(ema, val, ctx, device),
                lr,
            )
    if dist.get_rank() == 0:
        log_final(lm_loss(model, val, ctx, device))
    trainer.close()


if __name__ == "__main__":
    main()
