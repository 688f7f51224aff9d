"""One run of bench/hf_overhead_bench.py: a Hugging Face ``Trainer`` on a small GPT-2 built from a config (nothing
downloaded) under torchrun, plain or made elastic by ``make_elastic`` (no snapshots: no checkpoint URL), timing its
steady-state steps. Rank 0 writes ``{"system", "steps", "wall_s", "cpu_s", "steps_per_s", "steps_per_cpu_s"}`` to
``--out``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(TrainerCallback):
    """Wall and CPU time of the steps after the first ``warmup``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: tuple[float, float] | None = None
        self.end: tuple[float, float] | None = None
        self.steps = 0

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        step = state.global_step  # type: ignore[attr-defined]
        now = (time.perf_counter(), time.process_time())
        if step == self.warmup:
            self.start = now
        elif step > self.warmup:
            self.end, self.steps = now, step - self.warmup


def _time_adapter(session: object) -> list[float]:
    """Wrap the adapter's per-step work (the batch sampler's iteration, each micro-batch's bookkeeping, the commit
    at the boundary) to add up the CPU time spent in it: a share of the step that other load on the machine does
    not blur as it blurs a ratio of step rates."""
    total = [0.0]

    def timed(fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.process_time() - t

        return run

    s: Any = session
    s.commit = timed(s.commit)
    s.next_micro_batch = timed(s.next_micro_batch)
    sampler = s.batch_sampler
    base = type(sampler)

    class TimedSampler(base):  # type: ignore[misc, valid-type]
        def __iter__(self) -> Any:
            it = base.__iter__(self)
            while True:
                t = time.process_time()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    total[0] += time.process_time() - t
                yield item

    sampler.__class__ = TimedSampler
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["plain", "elastic"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 512
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers, n_head=4)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Windows(args.batch * args.accumulation * world * (args.steps + 1), args.seq, vocab)
    targs = TrainingArguments(
        output_dir=str(args.out.parent / f"hf-{args.system}"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-3,
        max_steps=args.steps,
        save_strategy="no",
        logging_steps=10_000,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    if args.system == "elastic":
        from elastic.integrations.hf import make_elastic

        make_elastic(trainer, base_world_size=world, save_every_steps=None)  # no checkpoint URL: no snapshots
        adapter_cpu = _time_adapter(trainer._elastic)  # type: ignore[attr-defined]
    else:
        adapter_cpu = None
    clock = Clock(args.warmup)
    trainer.add_callback(clock)
    trainer.train()
    if targs.process_index == 0:
        assert clock.start is not None and clock.end is not None
        wall, cpu = clock.end[0] - clock.start[0], clock.end[1] - clock.start[1]
        out = {
            "system": args.system,
            "steps": clock.steps,
            "wall_s": wall,
            "cpu_s": cpu,
            "steps_per_s": clock.steps / wall,
            "steps_per_cpu_s": clock.steps / cpu,
        }
        if adapter_cpu is not None:  # over every step, the warm-up's included
            out["adapter_cpu_ms_per_step"] = 1000 * adapter_cpu[0] / max(trainer.state.global_step, 1)
        args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
