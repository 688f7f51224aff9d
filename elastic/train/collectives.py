"""The loop's process group outside training itself: joining it (restart mode), its device, and small collectives:
a mean over the workers (and the loss log built on it), the round's node names.

Joining: the group the script made, else the one torchrun describes in the environment, else, for a plain
``python train.py`` (none of torchrun's variables set, :meth:`~elastic.contract.env.TorchrunEnv.launched`), a world
of one: rank 0 of 1 over an in-process store (no port, no network), with one INFO line saying so. A half-set
environment (``RANK`` without ``WORLD_SIZE``, ...) is a :class:`~elastic.contract.env.WorkerEnvError` naming what
is missing, not torch's ``env://`` error for the first variable it misses or a wait for peers that never come.

Each is a collective: every rank of the current process group must call it, in the same order.

:class:`HostCollectives` is where the loop's *host-side* agreements run (the step boundary's flags, the logged
mean loss, a snapshot's RNG gather): values the host must read at once.  On an NCCL group such a value makes
two stream syncs (``torch.tensor(..., device=cuda)`` copies from pageable memory, ``.tolist()`` copies back),
each waiting for all the work queued on the device: the host then stops at every step boundary until the GPU
has finished the step, and the GPU idles while the host prepares the next one.  In restart mode these run on a
gloo group over the same ranks (made once, with the loop's timeout) on CPU tensors, so the device's queue is
never drained by the loop.  Live mode keeps them on its own group: that group is re-formed in each generation
and its watchdog can abort NCCL, not a gloo collective stuck on a vanished peer.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic import compat
from elastic.contract.env import TorchrunEnv, WorkerEnv
from elastic.gloo_group import GlooGroupBeside
from elastic.train import console

logger = logging.getLogger("elastic.train.trainer")  # the loop's log, where users look for the loss line

__all__ = [
    "HostCollectives",
    "group_device",
    "join_process_group",
    "log_mean_loss",
    "mean_over_workers",
    "round_node_names",
    "takes_cpu_tensors",
    "trains_on_cuda",
]


def join_process_group(backend: str, timeout: timedelta) -> None:
    """The process group torchrun describes (its environment), unless the script made one already; outside
    torchrun a world of one (see the module docstring). The loop's console log is set up first
    (:func:`elastic.train.console.attach`)."""
    console.attach()
    if dist.is_initialized():
        return
    if TorchrunEnv.launched():
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    logger.info(
        "not started by torchrun (none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is set): training as "
        "a world of one process (%s); start it with torchrun for more",
        backend,
    )


def group_device() -> torch.device:
    """Where this rank trains: its local GPU when the default group runs CUDA tensors over NCCL (made the current
    device; :func:`trains_on_cuda`), else the CPU."""
    if trains_on_cuda(dist.get_backend(), torch.cuda.is_available()):
        local = TorchrunEnv.from_environ().local_rank
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def trains_on_cuda(backend: str, cuda_available: bool) -> bool:
    """Whether a default group of ``backend`` (as ``dist.get_backend()`` names it) trains on the GPU: ``"nccl"``,
    NCCL for CUDA tensors beside another backend (``"cpu:gloo,cuda:nccl"``, ``"cuda:nccl"``), or torch's default
    pair where there is a GPU (``"undefined"``: ``init_process_group()`` without a backend, which makes gloo for CPU
    tensors and NCCL for CUDA ones)."""
    name = backend.strip().lower()
    if name == "undefined":
        return cuda_available
    return any(part.split(":")[-1].strip() == "nccl" for part in name.split(","))


def takes_cpu_tensors(backend: str) -> bool:
    """Whether a default group of ``backend`` (as ``dist.get_backend()`` names it: ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``, ``"undefined"`` for torch's default pair, whose CPU part is gloo) runs collectives on
    CPU tensors itself."""
    name = backend.strip().lower()
    if name == "undefined":
        return True
    if ":" not in name:
        return name in ("gloo", "mpi")
    return any(part.split(":", 1)[0].strip() == "cpu" for part in name.split(","))


class HostCollectives:
    """Where the loop's host-side collectives run (see the module docstring): ``device`` for their tensors and
    :meth:`group` (None: the default group).  ``separate``: on CPU tensors over a gloo group of their own, made
    now (a collective: every rank constructs this at the same point) and again beside each new default group;
    otherwise over the default group on ``device``.  :meth:`for_loop` decides."""

    def __init__(self, device: torch.device, timeout: timedelta, *, separate: bool) -> None:
        self.separate = separate
        self.device = torch.device("cpu") if separate else device
        self._side = GlooGroupBeside("the loop's step-boundary agreements", timeout) if separate else None
        self.group()

    @property
    def groups_made(self) -> int:
        return self._side.made if self._side is not None else 0

    @classmethod
    def for_loop(cls, device: torch.device, timeout: timedelta, *, live: bool) -> HostCollectives:
        """Live mode: the default group on ``device``.  Restart mode: CPU tensors, over the default group where it
        takes them (gloo, ``cpu:gloo,cuda:nccl``), else (NCCL) over a gloo group of their own."""
        if live:
            return cls(device, timeout, separate=False)
        if takes_cpu_tensors(dist.get_backend()):
            return cls(torch.device("cpu"), timeout, separate=False)
        return cls(device, timeout, separate=True)

    def group(self) -> Any:
        """The group (a collective the first time for each default group: every rank calls it at that point)."""
        return self._side.get() if self._side is not None else None


def mean_over_workers(values: dict[str, float], device: torch.device, group: Any = None) -> dict[str, float]:
    """Mean of each value over all workers (one all-reduce over ``group``, in float64 on ``device``)."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    world = dist.get_world_size()
    return {k: float(v) / world for k, v in zip(keys, t.tolist(), strict=True)}


def log_mean_loss(step: int, epoch: int, loss: float | None, lr: float, rank: int, host: HostCollectives) -> None:
    """Rank 0 logs the step's loss averaged over the workers (a step without a loss counts as 0)."""
    mean = mean_over_workers({"loss": loss if loss is not None else 0.0}, host.device, host.group())["loss"]
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


def leave_process_group() -> None:
    """Every rank leaves the default group together (a barrier), then it is destroyed (nothing where none is)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    # gloo's worker thread frees finished work (which holds Python tensors) under the GIL; give it the GIL now, or
    # tearing the group down from the main thread can deadlock at exit.
    time.sleep(0.2)
    compat.destroy_process_group()
