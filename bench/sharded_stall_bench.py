"""What a snapshot costs the training loop: sharded (FSDP2, DCP) vs replicated (DDP) state of the same size per rank.

Two gloo processes train an MLP with AdamW. DDP: every rank holds the whole model (``--hidden`` x ``--depth``);
FSDP2: a model of twice the parameters (width ``--hidden`` x sqrt 2), sharded over the two ranks, so each rank
holds about the same bytes of parameters and optimizer state. Each round times ``--steps`` plain steps, then
``save`` of a snapshot (durable layout of the kind: the replicated one with the optimizer fence; the sharded one
through DCP's async save) and the steps after it. Figures per kind (median over rounds, rank 0):

- ``blocking``: the ``save`` call;
- ``stall``: the extra time of the ``--after`` steps after the save over as many plain steps.

Issue 27's goal: the sharded snapshot does not stall the loop longer than a replicated one of the same size per
rank. Prints a table and writes JSON (default bench/results/sharded_stall.json).

    python bench/sharded_stall_bench.py [--hidden 1024 --depth 6 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _stats import summarize  # noqa: E402

from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager  # noqa: E402
from elastic.checkpoint.state import capture_training_state  # noqa: E402
from elastic.train.sharded import capture_sharded  # noqa: E402


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [*model.parameters(), *(v for st in optimizer.state.values() for v in st.values())]
    return sum(local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _run(rank: int, args: argparse.Namespace, tmp: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    results: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            module = _mlp(args.hidden, args.depth)
            model: nn.Module = DistributedDataParallel(module)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            module = _mlp(int(args.hidden * math.sqrt(2)), args.depth)
            mesh = init_device_mesh("cpu", (2,))
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
            model = module
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        layout = StateLayout.SHARDED if kind == "fsdp" else StateLayout.REPLICATED
        manager = create_checkpoint_manager(f"{tmp}/{kind}", CheckpointOptions(layout=layout, keep_last=2))
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 8, (32,), generator=g)

        def step(
            model: nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
        ) -> float:
            started = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            return time.perf_counter() - started

        for _ in range(3):
            step()
        blocking, stall = [], []
        for r in range(args.rounds):
            plain = sum(step() for _ in range(args.after))
            manager.wait()
            dist.barrier()
            started = time.perf_counter()
            if kind == "fsdp":
                manager.save(100 + r, capture_sharded(100 + r, module, optimizer, None))
            else:
                manager.save(100 + r, capture_training_state(100 + r, module, optimizer, None), overlap_with=optimizer)
            blocking.append(time.perf_counter() - started)
            after = sum(step() for _ in range(args.after))
            stall.append(max(0.0, after - plain))
        manager.close()
        results[kind] = {
            "state_bytes": _state_bytes(module, optimizer),
            "blocking_s": blocking,
            "stall_s": stall,
            "step_s": plain / args.after,
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--after", type=int, default=4, help="steps timed after each save")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "sharded_stall.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sharded-stall-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_run, args=(args, tmp, out), nprocs=2, start_method="spawn")
        results = json.loads(Path(out).read_text())
    print(f"snapshot cost per rank, 2 gloo ranks, AdamW, {args.rounds} rounds (median / p95)")
    print(f"{'kind':6s} {'state/rank MiB':>15s} {'step ms':>8s} {'save blocks ms':>16s} {'next steps stall ms':>20s}")
    summary: dict[str, Any] = {}
    for kind, r in results.items():
        b, s = summarize(r["blocking_s"]), summarize(r["stall_s"])
        summary[kind] = {"state_bytes": r["state_bytes"], "step_s": r["step_s"], "blocking_s": b, "stall_s": s}
        print(
            f"{kind:6s} {r['state_bytes'] / 2**20:15.1f} {r['step_s'] * 1e3:8.1f} "
            f"{b['median'] * 1e3:8.1f} / {b['p95'] * 1e3:5.1f} {s['median'] * 1e3:10.1f} / {s['p95'] * 1e3:6.1f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "args": {k: str(v) for k, v in vars(args).items()},
                "results": summary,
                "raw": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
