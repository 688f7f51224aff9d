"""A plain Hugging Face ``Trainer`` script plus the one elastic line (docs/integrations.md).

A small GPT-2 built from a config (nothing downloaded) learns byte-level text: the source of a few modules of
Python's own standard library, cut into windows. Without the ``make_elastic`` line it is the ``Trainer`` script of
the transformers tutorials; with it, under torchrun on the etcd-v3 rendezvous, nodes may come and go:

    torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=etcd-v3 \\
        --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=hf1 -m elastic.prefork examples/hf_trainer.py --checkpoint-url ckpt/hf

or ``python examples/hf_trainer.py`` (a world of one). Every sample is seen once per epoch whatever the number of
workers, the global batch of 2 workers x 8 x 2 accumulation steps is kept (a world of 1 accumulates 4 micro-batches,
one of 4 accumulates 1), snapshots go to ``--checkpoint-url`` (any fsspec URL: a path, ``s3://...``) every 50 steps
and on SIGTERM, and a restarted run resumes from the newest verified one by itself.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to fetch

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from elastic.integrations.hf import make_elastic

WINDOW = 64


class ByteWindows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Windows of ``WINDOW`` bytes of some standard-library sources; the labels are the inputs (the model shifts)."""

    def __init__(self) -> None:
        text = "".join(inspect.getsource(m) for m in (argparse, inspect, json)).encode()
        data = torch.tensor(list(text), dtype=torch.long)
        self.windows = data[: len(data) // WINDOW * WINDOW].view(-1, WINDOW)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-url", default=os.environ.get("ETRAIN_CHECKPOINT_URL", "ckpt/hf_trainer"))
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--max-steps", type=int, default=-1)
    args = p.parse_args()

    data = ByteWindows()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=4))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        logging_steps=10,
        save_strategy="no",  # the elastic snapshots replace output_dir checkpoints (both can run: see the docs)
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer = make_elastic(trainer, checkpoint_url=args.checkpoint_url, base_world_size=2)  # the one elastic line
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(json.dumps({"step": result.global_step, "train_loss": result.training_loss}))


if __name__ == "__main__":
    main()
