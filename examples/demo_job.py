"""A small self-contained elastic training job for the service demo and tests (gloo, CPU, tiny model).

Run by the node agents under stock torchrun. It resumes from the latest committed checkpoint under
``ETRAIN_CHECKPOINT_URL`` (``file://`` or a plain path), trains a linear regression with DDP, saves a
checkpoint from rank 0 every ``--checkpoint-every`` steps (write to a temporary name, then rename, then
update ``LATEST`` the same way) and reports progress to the service through ``elastic.progress``.

The learning rate follows ``ETRAIN_LR_POLICY`` (JSON ``{"scaling": "linear"|"sqrt"|"none",
"base_lr": float, "base_world_size": int}``), re-computed from the world size at every (re)start.

It stands in for the project's elastic training loop; swapping it means pointing the job's
``entrypoint`` at the real loop, nothing else in the service changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic.progress import create_reporter

logger = logging.getLogger("demo_job")


def _checkpoint_dir(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else url)
    raise SystemExit(f"demo_job: only file:// checkpoint URLs are supported, got {url!r}")


def _lr(world_size: int) -> float:
    policy = json.loads(os.environ.get("ETRAIN_LR_POLICY") or "{}")
    base = float(policy.get("base_lr", 0.05))
    ref = int(policy.get("base_world_size") or 1)
    scaling = policy.get("scaling", "linear")
    ratio = world_size / ref
    if scaling == "linear":
        return base * ratio
    if scaling == "sqrt":
        return base * math.sqrt(ratio)
    return base


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _load_latest(ckpt_dir: Path) -> dict | None:
    latest = ckpt_dir / "LATEST"
    if not latest.exists():
        return None
    path = ckpt_dir / latest.read_text().strip()
    try:
        state: dict = torch.load(path, map_location="cpu", weights_only=True)
        return state
    except Exception as exc:  # a torn or corrupt file: start from scratch rather than crash
        logger.warning("cannot load checkpoint %s (%s); starting from step 0", path, exc)
        return None


def _save(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, keep: int = 3) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}.pt"
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    _atomic_write(ckpt_dir / name, lambda p: torch.save(state, p))
    _atomic_write(ckpt_dir / "LATEST", lambda p: p.write_text(name + "\n"))
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return ckpt_dir / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="rank 0 exits with code 3 at this step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s demo_job %(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job_id = os.environ.get("ETRAIN_JOB_ID", "local")
    ckpt_url = os.environ.get("ETRAIN_CHECKPOINT_URL") or f"/tmp/etrain-demo-{job_id}"
    ckpt_dir = _checkpoint_dir(ckpt_url)
    reporter = create_reporter()

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=_lr(world))
    start = 0
    state = _load_latest(ckpt_dir)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    for group in opt.param_groups:
        group["lr"] = _lr(world)
    ddp = DistributedDataParallel(model)
    if rank == 0:
        for stale in ckpt_dir.glob("*.tmp.*"):  # left by a worker killed mid-save
            stale.unlink(missing_ok=True)
        logger.info("world size %d, resuming at step %d, lr %.4f", world, start, _lr(world))
        reporter.report(start, world_size=world, total_steps=args.steps, force=True)

    true_w = torch.arange(8, dtype=torch.float32) / 8
    loss_value = float("nan")
    for step in range(start + 1, args.steps + 1):
        if rank == 0 and step == args.fail_at_step:
            logger.error("failing on purpose at step %d", step)
            return 3
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 8, generator=gen)
        y = x @ true_w + 0.01 * torch.randn(32, generator=gen)
        loss = nn.functional.mse_loss(ddp(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        detached = loss.detach()
        dist.all_reduce(detached)
        loss_value = float(detached) / world
        if rank == 0:
            if step % args.checkpoint_every == 0 or step == args.steps:
                path = _save(ckpt_dir, step, model, opt)
                reporter.report(
                    step, world_size=world, loss=loss_value, total_steps=args.steps,
                    checkpoint_step=step, checkpoint_path=str(path),
                )  # fmt: skip
            else:
                reporter.report(step, world_size=world, loss=loss_value, total_steps=args.steps)
    dist.barrier()
    if rank == 0:
        logger.info("finished %d steps, final loss %.5f", args.steps, loss_value)
    reporter.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
