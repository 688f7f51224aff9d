"""Several real ranks of one test (gloo process groups), started the way the suite starts them everywhere.

:func:`start_ranks` runs ``fn(rank, *args)`` in ``nprocs`` processes (``torch.multiprocessing.start_processes``,
which raises if a rank fails) with the ``forkserver`` start method: one server per pytest process imports torch
once (:data:`PRELOAD`) and forks every rank of every such test from there. With ``spawn`` each rank was a fresh
interpreter that imported torch, and exited through a full collection over its objects: ~4 of the ~9 CPU-s a
rank of these tests cost on the 2-core VM. A forked rank is as fresh as a spawned one where it matters here (the
server is single-threaded, never opened a process group), and exits without finalisers (``os._exit``).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.nn.functional"]


def start_ranks(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)  # only read when this process's server starts (the first call)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
