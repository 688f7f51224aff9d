"""Worker for loop_overhead_bench.py: one model trained by plain DDP or by the ElasticTrainer (restart mode
with DDP, or ``--mode live``: live recovery, whose gradient all-reduce is the loop's own).

``--model char``: the char transformer of the examples (CPU, gloo).  ``--model mlp``: an MLP + AdamW whose
state is ``--state-gib`` GiB (bench/_workload.py), fed with index batches that select rows of a table kept
on the device (so that building a batch costs nothing next to a GPU step; ``--width`` sets its layers' width).
On ``--device cuda`` the process group is NCCL and the model lives on ``LOCAL_RANK``'s GPU.  Every mode
reads the loss once per step: plain DDP with ``float(loss)`` after ``optimizer.step()`` (a stream sync, as a
stock loop that logs its loss does), the elastic loop through its own pinned copy, which waits for the forward
pass only (elastic/train/step_loss.py).

The user's own ``DataLoader`` (issue 49): ``--loader-workers N`` (N > 0) feeds plain DDP from
``DataLoader(dataset, batch_size, sampler=DistributedSampler, num_workers=N, persistent_workers=True)`` and the
elastic loop from ``DataLoader(dataset, batch_sampler=ElasticBatchSampler(dataset), num_workers=N,
persistent_workers=True)`` passed as its ``data`` (without it, the loop collates a plain data set in-process).
``--form own`` runs the loop's own-step form (``trainer.steps()``, the script's ``optimizer.step()``) instead of
the short one (``trainer.batches()``). ``--sample-spin K`` makes ``__getitem__`` a CPU transform of fixed cost
(K iterations of a pure-Python loop before the sample is returned): the data-bound case. ``--mode calibrate``
(no torchrun) measures the CPU seconds of one step of the model on one thread and the spin's iterations per CPU
second, so that the bench can size K.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))
from _workload import GiB, Workload, state_bytes  # noqa: E402
from common import DATA, CharDataset, TinyTransformer  # noqa: E402

from elastic import ElasticConfig, ElasticTrainer, LRPolicy, compat  # noqa: E402
from elastic.train.batch_sampler import ElasticBatchSampler  # noqa: E402


class Indices(Dataset[int]):
    """Sample ``i`` is just ``i``: the MLP's input is row ``i % rows`` of a table on the device."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def spin(iterations: int) -> int:
    """A fixed amount of CPU work (a pure-Python loop, holding the GIL as a Python transform does)."""
    acc = 0
    for k in range(iterations):
        acc ^= k
    return acc


class Costly(Dataset[Any]):
    """``dataset[i]`` after ``spin(iterations)``: a ``__getitem__`` of a fixed CPU cost (the data-bound case)."""

    def __init__(self, dataset: Any, iterations: int) -> None:
        self.dataset, self.iterations = dataset, iterations

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        spin(self.iterations)
        return self.dataset[i]


def data_loader(dataset: Any, args: argparse.Namespace, cuda: bool, **sampling: Any) -> DataLoader[Any]:
    """The script's own ``DataLoader``: ``--loader-workers`` persistent workers, pinned memory on a GPU."""
    workers = {}
    if args.loader_workers:
        workers = {
            "num_workers": args.loader_workers,
            "persistent_workers": True,
            "multiprocessing_context": args.loader_context,
        }
    return DataLoader(dataset, pin_memory=cuda, **sampling, **workers)


def calibrate(args: argparse.Namespace) -> None:
    """``--mode calibrate``: the CPU seconds of one step of the model (one thread, no process group; median of
    ``--steps`` after ``--warmup``) and the spin's iterations per CPU second (best of 5)."""
    torch.set_num_threads(1)
    model, dataset, loss_of = build(args, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = iter(DataLoader(dataset, batch_size=args.batch, shuffle=True))
    step_cpu: list[float] = []
    for k in range(args.warmup + args.steps):
        batch = next(loader)
        t0 = time.thread_time()
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        float(loss.detach())
        if k >= args.warmup:
            step_cpu.append(time.thread_time() - t0)
    n, rates = 2_000_000, []
    for _ in range(5):
        t0 = time.thread_time()
        spin(n)
        rates.append(n / (time.thread_time() - t0))
    args.out.write_text(json.dumps({"step_cpu_s": sorted(step_cpu)[len(step_cpu) // 2], "spin_per_cpu_s": max(rates)}))


def build(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """(model on the device, dataset, loss of one batch through a given module: the DDP wrapper, whose
    forward is what makes the backward all-reduce the gradients)."""
    if args.model == "char":
        dataset = CharDataset(DATA / "tiny_shakespeare.txt")
        model = TinyTransformer(len(dataset.chars)).to(device)

        def char_loss(net: torch.nn.Module, batch: Any) -> torch.Tensor:
            x, y = (t.to(device, non_blocking=True) for t in batch)
            logits = net(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return model, dataset, char_loss
    workload = Workload(int(args.state_gib * GiB), device, "adamw", width=args.width, batch=args.batch)
    table = torch.randn(256, workload.width, device=device)

    def mlp_loss(net: torch.nn.Module, batch: Any) -> torch.Tensor:
        rows = table[batch.to(device, non_blocking=True) % table.shape[0]]
        return net(rows).pow(2).mean()

    return workload.model, Indices(10_000_000), mlp_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "elastic", "live", "calibrate"], required=True)
    p.add_argument("--model", choices=["char", "mlp"], default="char")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--state-gib", type=float, default=1.5)
    p.add_argument("--width", type=int, default=None, help="--model mlp: layer width (default: 8192 cuda, 2048 cpu)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint-url", default=None)
    p.add_argument("--save-every", type=int, default=100, help="0: no checkpoints")
    p.add_argument("--when-writer-busy", choices=["defer", "wait"], default="defer")
    p.add_argument("--nodes", type=int, default=1, help="torchrun agents of the run (live mode's world)")
    p.add_argument("--loader-workers", type=int, default=0, help="> 0: a DataLoader with these persistent workers")
    p.add_argument("--loader-context", choices=["fork", "forkserver", "spawn"], default="fork")
    p.add_argument("--form", choices=["short", "own"], default="short", help="the elastic loop's form")
    p.add_argument("--sample-spin", type=int, default=0, help="__getitem__'s busy loop, iterations per sample")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--threads", type=int, default=1, help="cpu: torch's threads (0: torch's default)")
    args = p.parse_args()
    if args.mode == "calibrate":
        calibrate(args)
        return
    cuda = args.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        device = torch.device("cpu")
    live = args.mode == "live"
    if not live:  # live mode: the trainer forms the group itself (elastic.live)
        dist.init_process_group("nccl" if cuda else "gloo")
    model, dataset, loss_of = build(args, device)
    if args.sample_spin:
        dataset = Costly(dataset, args.sample_spin)
    if not live:
        model = DDP(model, device_ids=[device.index] if cuda else None)
    lr = 1e-3 if args.model == "char" else 1e-5
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=lr)
        if args.optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    times: list[float] = []
    cpu: list[float] = []
    thread_cpu: list[float] = []  # the main thread's CPU (the rest of the process's is the writer's, hasher's, ...)
    gc_pauses: list[tuple[float, float]] = []  # (start, end) of each collection, perf_counter

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            gc_pauses.append((time.perf_counter(), 0.0))
        elif gc_pauses:
            gc_pauses[-1] = (gc_pauses[-1][0], time.perf_counter())

    gc.callbacks.append(on_gc)
    save_every = args.save_every if args.checkpoint_url else 0
    snapshots: dict[str, Any] = {"saved": 0}  # what was saved (the elastic loop: deferred ones too)

    if args.mode == "plain":
        rank = dist.get_rank()
        sampler = DistributedSampler(dataset, seed=0)
        loader = data_loader(dataset, args, cuda, batch_size=args.batch, sampler=sampler)
        epoch = 0
        while len(times) < args.steps:
            sampler.set_epoch(epoch)
            for batch in loader:
                optimizer.zero_grad()
                loss = loss_of(model, batch)
                loss.backward()
                optimizer.step()
                float(loss.detach())  # read the loss every step, as a stock loop that logs it does
                if save_every and (len(times) + 1) % save_every == 0 and rank == 0:
                    # the tutorial way: a synchronous torch.save from rank 0, then move on
                    Path(args.checkpoint_url).mkdir(parents=True, exist_ok=True)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                    torch.save(state, Path(args.checkpoint_url) / "latest.pt")
                    snapshots["saved"] += 1
                times.append(time.perf_counter())
                cpu.append(time.process_time())
                thread_cpu.append(time.thread_time())
                if len(times) >= args.steps:
                    break
            epoch += 1
    else:
        world = int(os.environ["WORLD_SIZE"]) if not live else int(os.environ["LOCAL_WORLD_SIZE"]) * args.nodes
        policy = LRPolicy("linear", optimizer.param_groups[0]["lr"], world, args.batch)
        config = ElasticConfig(
            policy,
            args.checkpoint_url,
            save_every_steps=save_every or None,
            progress_every=0,
            when_writer_busy=args.when_writer_busy,
            recovery="live" if live else None,
        )
        # the script's own DataLoader over the loop's batch sampler, or the data set, collated in this process
        data = (
            data_loader(dataset, args, cuda, batch_sampler=ElasticBatchSampler(dataset))
            if (args.loader_workers)
            else dataset
        )
        trainer = ElasticTrainer(model, optimizer, data, config)
        rank = trainer.rank  # ElasticTrainer.close() leaves the process group: remember who writes

        def committed() -> None:
            if len(times) < trainer.step:  # one more step committed
                times.append(time.perf_counter())
                cpu.append(time.process_time())
                thread_cpu.append(time.thread_time())

        if args.form == "short":
            for batch in trainer.batches(epochs=100):
                trainer.backward(loss_of(trainer.model, batch))
                committed()  # the optimizer step runs inside batches(), before the next batch
                if trainer.step >= args.steps:
                    break
        else:  # the own-step form: the script steps its optimizer; the step commits when the next one is asked for
            for step in trainer.steps(epochs=100):
                committed()
                if trainer.step >= args.steps:
                    break
                for batch in step:
                    step.backward(loss_of(trainer.model, batch))
                optimizer.step()
        stats = trainer.snapshot_stats  # the durable snapshots started, and those a busy writer deferred
        snapshots = {"saved": stats.saved, "deferred": stats.deferred, "skipped": stats.skipped}
        trainer.close()
    if rank == 0:
        steady = times[args.warmup :]
        rate = (len(steady) - 1) / (steady[-1] - steady[0])
        cpu_steady = cpu[args.warmup :]
        cpu_rate = (len(cpu_steady) - 1) / (cpu_steady[-1] - cpu_steady[0])  # steps per CPU-second of rank 0
        start, end = steady[0], steady[-1]
        gc_s = sum(min(b, end) - max(a, start) for a, b in gc_pauses if b > start and a < end)
        args.out.write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "steps_per_s": rate,
                    "steps_per_cpu_s": cpu_rate,
                    "steps": len(times),
                    # the steady steps one by one (bench/_attribution.py): times[k] ends step k + 1
                    "step_seconds": [b - a for a, b in itertools.pairwise(steady)],
                    "first_step": args.warmup + 2,
                    "gc_s": gc_s,
                    "main_cpu_s": thread_cpu[-1] - thread_cpu[args.warmup],
                    "process_cpu_s": cpu_steady[-1] - cpu_steady[0],
                    "snapshots": snapshots,
                    "state_bytes": state_bytes([model.state_dict(), optimizer.state_dict()]),
                }
            )
        )
    if dist.is_initialized():
        # the plain loop's last collective may still be draining in gloo's threads ("terminate called without
        # an active exception" at exit, seen once in three runs): a barrier, then the drained teardown
        dist.barrier()
        compat.destroy_process_group()


if __name__ == "__main__":
    main()
