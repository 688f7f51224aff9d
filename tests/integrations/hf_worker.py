"""A Hugging Face ``Trainer`` script made elastic by one line, for the integration tests: a tiny GPT-2 built from a
config (2 layers, ``n_embd`` 32; nothing downloaded) trained on token sequences made here, under torchrun.

Records, per rank, one JSON line per committed step (``rank<R>.jsonl``: step, epoch, world, lr, indices, global
batch, accumulation, restart, attempt; the format of ``tests/integration/training_records.py``); at the end rank 0
writes ``final.json`` (the mean loss of the final model over the whole data set) and ``final_params.pt``.

    torchrun ... tests/integrations/hf_worker.py --record DIR --checkpoint-url URL [--steps N | --epochs E]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from elastic.contract.lr import LRPolicy, LRRule
from elastic.integrations.hf import make_elastic
from elastic.train.config import StepInfo

VOCAB, SEQ = 64, 16


class Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` sequences of SEQ tokens: an arithmetic progression mod VOCAB with a per-sequence stride (learnable)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--checkpoint-url", required=True)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--steps", type=int, default=-1)
    p.add_argument("--batch", type=int, default=4, help="per-device batch at the base world")
    p.add_argument("--accumulation", type=int, default=1, help="accumulation steps at the base world")
    p.add_argument("--base-world", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-rule", default="fixed-global-batch")
    p.add_argument("--warmup", type=int, default=0, help="the policy's LR ramp after a resize")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--accelerate",
        action="store_true",
        help="the script's own loop with an Accelerator (elastic/integrations/accelerate.py) instead of the Trainer",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    args.record.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}:{os.environ.get('WORLD_SIZE')}"

    data = Sequences(args.samples)
    model = make_model(args.seed)
    if args.accelerate:
        run_accelerate(args, data, model, restart, attempt)
        return
    targs = TrainingArguments(
        output_dir=str(args.record / "hf-out"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        max_steps=args.steps,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        save_strategy="no",
        logging_steps=1000,
        report_to="none",
        seed=args.seed,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    rank = targs.process_index
    log = args.record / f"rank{rank}.jsonl"

    def on_step(info: StepInfo) -> None:
        plan = policy.step_plan(info.world_size)
        record = {
            "step": info.step,
            "epoch": info.epoch,
            "rank": info.rank,
            "world": info.world_size,
            "lr": info.lr,
            "indices": list(info.indices),
            "global_batch": plan.global_batch,
            "accumulation": targs.gradient_accumulation_steps,
            "restart": restart,
            "t": time.time(),
            "attempt": attempt,
            "pid": os.getpid(),
        }
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")

    policy = LRPolicy(
        LRRule(args.lr_rule),
        args.lr,
        args.base_world,
        args.batch,
        warmup_steps=args.warmup,
        accumulation_steps=args.accumulation,
    )
    # the one elastic line
    make_elastic(
        trainer, checkpoint_url=args.checkpoint_url, policy=policy, save_every_steps=args.save_every, on_step=on_step
    )

    if args.step_sleep > 0:

        class Sleep(TrainerCallback):
            def on_step_end(self, *a: object, **k: object) -> None:
                time.sleep(args.step_sleep)

        trainer.add_callback(Sleep())
    trainer.train()

    if rank == 0:
        final(args, data, trainer.accelerator.unwrap_model(trainer.model_wrapped), trainer.state.global_step)


def run_accelerate(
    args: argparse.Namespace, data: Sequences, model: GPT2LMHeadModel, restart: int, attempt: str
) -> None:
    """The same training as the Trainer's (AdamW, linear decay to 0 over the run's steps, no clipping) in a loop of
    the script's own with an ``Accelerator``."""
    from accelerate import Accelerator

    from elastic.integrations.accelerate import ElasticAccelerate

    accelerator = Accelerator(cpu=True)
    policy = LRPolicy(
        LRRule(args.lr_rule),
        args.lr,
        args.base_world,
        args.batch,
        warmup_steps=args.warmup,
        accumulation_steps=args.accumulation,
    )
    steps_per_epoch = -(-len(data) // policy.step_plan(1).global_batch)
    total = args.steps if args.steps > 0 else int(steps_per_epoch * args.epochs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (total - s) / total))
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    log = args.record / f"rank{rank}.jsonl"

    def on_step(info: StepInfo) -> None:
        plan = policy.step_plan(info.world_size)
        record = {
            "step": info.step,
            "epoch": info.epoch,
            "rank": info.rank,
            "world": info.world_size,
            "lr": info.lr,
            "indices": list(info.indices),
            "global_batch": plan.global_batch,
            "accumulation": plan.accumulation_steps,
            "restart": restart,
            "t": time.time(),
            "attempt": attempt,
            "pid": os.getpid(),
        }
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")

    elastic = ElasticAccelerate(
        accelerator,
        model,
        optimizer,
        data,
        policy,
        checkpoint_url=args.checkpoint_url,
        scheduler=scheduler,
        save_every_steps=args.save_every,
        on_step=on_step,
    )
    loader = torch.utils.data.DataLoader(data, batch_sampler=elastic.batch_sampler)
    for step in elastic.steps(loader, max_steps=total):
        for batch in step:
            step.backward(model(**batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
    if rank == 0:
        final(args, data, accelerator.unwrap_model(model), elastic.step)


def final(args: argparse.Namespace, data: Sequences, module: torch.nn.Module, step: int) -> None:
    """Rank 0: the final model's mean loss over the whole data set, and its parameters."""
    module.eval()
    with torch.no_grad():
        loss = float(module(input_ids=data.ids, labels=data.ids).loss)
    (args.record / "final.json").write_text(json.dumps({"loss": loss, "step": step}))
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, args.record / "final_params.pt")


if __name__ == "__main__":
    main()
