"""A torchrun worker that checks a gloo all-reduce every step and logs one JSON line per step.

Run under torchrun: ``python -m torch.distributed.run ... elastic/testing/allreduce_worker.py --out DIR``.
Each step all-reduces ``rank + 1`` and checks the sum ``world * (world + 1) / 2`` (a wrong world or a
mixed-up group fails loudly). Rank 0 records the last finished step in ``DIR/step``; a restarted group
resumes after it, so steps continue across re-formed worlds. Logs go to ``DIR/steps.jsonl``; ``DIR/done``
is written when ``--steps`` are reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic import compat
from elastic.contract import env as contract
from elastic.interpreter import freeze_at_exit


def _append(path: Path, record: dict[str, object]) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.1)
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get(contract.TORCHRUN_RESTART_COUNT, "0"))
    node = os.environ.get(contract.TORCHRUN_GROUP_RANK, "?")
    step_file = out / "step"
    start = int(step_file.read_text()) if step_file.exists() else 0
    # Everyone starts from rank 0's view of the step.
    t = torch.tensor([start], dtype=torch.int64)
    dist.broadcast(t, 0)
    step = int(t.item())
    _append(
        out / "events.jsonl",
        {
            "event": "start",
            "t": time.time(),
            "rank": rank,
            "world": world,
            "restart": restart,
            "pid": os.getpid(),
            "step": step,
        },
    )
    expected = world * (world + 1) / 2
    while step < args.steps:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        if x.item() != expected:
            print(f"all-reduce mismatch: got {x.item()} expected {expected}", file=sys.stderr)
            return 3
        step += 1
        if rank == 0:
            tmp = out / f"step.tmp{os.getpid()}"
            tmp.write_text(str(step))
            os.replace(tmp, step_file)
        _append(
            out / "steps.jsonl",
            {
                "t": time.time(),
                "step": step,
                "rank": rank,
                "world": world,
                "restart": restart,
                "node": node,
                "pid": os.getpid(),
                "sum": x.item(),
            },
        )
        time.sleep(args.step_time)
    dist.barrier()
    if rank == 0:
        (out / "done").write_text(str(step))
    compat.destroy_process_group()
    return 0


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    sys.exit(main())
