"""A character-level GPT, nanoGPT style, with plain DDP (the baseline that elastic_nanogpt.py changes): random
windows of the text drawn with replacement, bf16 autocast (fp16 and a GradScaler on a GPU without bf16), gradient
accumulation with the all-reduce on the last micro-step only, gradient clipping, a cosine LR with warmup set at every
iteration, an EMA of the weights, and an evaluation every --eval-interval iterations.

    torchrun --nproc-per-node=2 examples/ddp_nanogpt.py
"""

import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import DATA, CharDataset, TinyTransformer, get_batch, lm_loss, log_final, setup_logging
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
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
    ddp_model = DDP(model)
    for it in range(1, args.max_iters + 1):
        lr = cosine_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(args.accum):
            x, y = get_batch(train, args.batch)
            ddp_model.require_backward_grad_sync = micro == args.accum - 1  # all-reduce on the last micro-step
            with ctx:
                logits = ddp_model(x.to(device))
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
            scaler.scale(loss / args.accum).backward()
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
