"""The loop's small collectives outside training itself: a mean over the workers, and the round's node names.

Each is a collective: every rank of the current process group must call it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastic.contract.env import WorkerEnv

__all__ = ["mean_over_workers", "round_node_names"]


def mean_over_workers(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean of each value over all workers (one all-reduce, in float64 on ``device``)."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    world = dist.get_world_size()
    return {k: float(v) / world for k, v in zip(keys, t.tolist(), strict=True)}


def round_node_names() -> list[str] | None:
    """The service's names of this round's nodes (one all-gather), or None outside the service. The job service
    sets ``ETRAIN_NODE_NAME`` for every worker of a job, so every rank takes part or none does."""
    job = WorkerEnv.from_environ().job
    if job is None:
        return None
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, job.node_name)
    return sorted({str(n) for n in names})
