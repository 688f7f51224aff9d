"""The loop's process group outside training itself: joining it (restart mode), its device, and small collectives:
a mean over the workers (and the loss log built on it), the round's node names.

Each is a collective: every rank of the current process group must call it, in the same order.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.contract.env import TorchrunEnv, WorkerEnv

logger = logging.getLogger("elastic.train.trainer")  # the loop's log, where users look for the loss line

__all__ = ["group_device", "join_process_group", "log_mean_loss", "mean_over_workers", "round_node_names"]


def join_process_group(backend: str, timeout: timedelta) -> None:
    """The process group torchrun describes (its environment), unless the script made one already."""
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)


def group_device() -> torch.device:
    """Where this rank trains: its local GPU under NCCL (made the current device), else the CPU."""
    if dist.get_backend() == "nccl":
        local = TorchrunEnv.from_environ().local_rank
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def mean_over_workers(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean of each value over all workers (one all-reduce, in float64 on ``device``)."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    world = dist.get_world_size()
    return {k: float(v) / world for k, v in zip(keys, t.tolist(), strict=True)}


def log_mean_loss(step: int, epoch: int, loss: float | None, lr: float, rank: int, device: torch.device) -> None:
    """Rank 0 logs the step's loss averaged over the workers (a step without a loss counts as 0)."""
    mean = mean_over_workers({"loss": loss if loss is not None else 0.0}, device)["loss"]
    if rank == 0:
        logger.info("step %d epoch %d loss %.5f world %d lr %.6g", step, epoch, mean, dist.get_world_size(), lr)


def round_node_names() -> list[str] | None:
    """The service's names of this round's nodes (one all-gather), or None outside the service. The job service
    sets ``ETRAIN_NODE_NAME`` for every worker of a job, so every rank takes part or none does."""
    job = WorkerEnv.from_environ().job
    if job is None:
        return None
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, job.node_name)
    return sorted({str(n) for n in names})
