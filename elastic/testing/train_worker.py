"""A small elastic training job for tests and benchmarks, run under torchrun.

It trains a little MLP on a deterministic synthetic classification set through :class:`ElasticTrainer`,
and records, per rank, one JSON line per committed step (step, epoch, world, lr, indices, restart count)
in ``--record DIR/rank<R>.<pid>.jsonl``. At the end rank 0 evaluates the model on the whole data set and
writes ``final.json`` (loss, step) and ``final_params.pt``; every rank writes ``final_params.rank<R>.pt`` and
``final.rank<R>.json`` (its attempt and step), so that replicas can be compared. Under the job service it
reports progress (``elastic.train.progress``; a no-op elsewhere) and takes ``$ETRAIN_CHECKPOINT_URL`` by default.

``--fsdp`` shards the MLP with FSDP2's ``fully_shard`` (each linear layer and the root) before handing it to the
trainer; the final parameters are then the full state dict gathered to rank 0. ``--max-steps K`` stops the loop
once step K is committed (its snapshot, when one is due, taken); ``--dump-steps K,...`` and ``--dump-start``
write, from rank 0, the full model and optimizer state (``get_state_dict`` with ``full_state_dict=True``) at
those steps and right after the trainer restored (``dump-step<K>.pt``, ``dump-start.pt``).

``--hold-file PATH --hold-epoch E``: from the first step of epoch E on, each step waits, after its record is
written, while PATH exists (a SIGTERM ends the wait at once: torchrun re-forming for a joiner; ``--hold-max S``
bounds one step's wait, for live recovery, which admits joiners at step boundaries). A scenario test creates PATH
and removes it once the kills and joins it waits for happened, so that however slow the machine, the job cannot
end before them.

``--pace-file PATH``: ``--step-sleep`` applies only while PATH exists. A scenario paces its job only until its last
event happened (a hold file doubles as it): the steps after it run at full speed.

``--wait-local``: each step, after its record, waits until this rank's node-local snapshot of the step before is
written (``ElasticTrainer.local_snapshot_in_flight``), so that no snapshot is skipped for a busy writer: the job's
steps are never shorter than its writes, whatever the load (a write on a loaded disk can take several steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import TensorDataset

from elastic import compat
from elastic.checkpoint import CheckpointOptions
from elastic.contract import env as worker_env
from elastic.contract.lr import LRPolicy, LRRule
from elastic.interpreter import freeze_at_exit
from elastic.train.trainer import ElasticConfig, ElasticTrainer, LiveOptions, RecoveryMode, StepInfo


def make_dataset(n: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed: int, dropout: float = 0.1, hidden: int = 32, depth: int = 0) -> nn.Module:
    """16 -> ``hidden`` (-> ``hidden``, ``depth`` times) -> 4; the defaults are the tests' small MLP (benchmarks make
    it bigger to have state worth loading)."""
    torch.manual_seed(seed)
    middle = [m for _ in range(depth) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
    return nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(dropout), *middle, nn.Linear(hidden, 4))


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each linear layer, then the root, on the trainer's mesh (``--parallelize``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shard(model: nn.Module, hsdp_shard: int = 0) -> nn.Module:
    """FSDP2 over the whole world (``hsdp_shard`` 0), or HSDP: a 2-D mesh of world / ``hsdp_shard`` replicas, each
    sharded over ``hsdp_shard`` ranks; each linear layer a unit of its own, then the root."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")  # the mesh needs the group; the trainer then uses it
    world = dist.get_world_size()
    if hsdp_shard:
        if world % hsdp_shard:
            raise SystemExit(f"--hsdp-shard {hsdp_shard} does not divide the world size {world}")
        mesh = init_device_mesh("cpu", (world // hsdp_shard, hsdp_shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    return parallelize(model, mesh)


def full_state(trainer: ElasticTrainer) -> dict[str, object]:
    """The full model and optimizer state, on rank 0 (a collective; other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(trainer.module, trainer.optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd, "step": trainer.step, "world": trainer.world_size}


def _module_state(trainer: ElasticTrainer, fsdp: bool) -> dict[str, torch.Tensor]:
    """This rank's full copy of the parameters (DDP), or the gathered full state on rank 0 (FSDP; a collective)."""
    if fsdp:
        model_sd = full_state(trainer)["model"]
        assert isinstance(model_sd, dict)
        return {k: v.clone() for k, v in model_sd.items()}
    return {k: v.clone() for k, v in trainer.module.state_dict().items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _digest(trainer: ElasticTrainer, sharded: bool = False) -> str | None:
    """A hash of the replica's parameters and optimizer state: equal on every rank when replicas agree bit for bit.
    ``sharded`` (``--parallelize``): of this rank's shards, equal on the ranks of one shard index."""
    if compat.is_sharded_module(trainer.module) and not sharded:
        return None  # sharded by the script: each rank holds other parameters
    h = hashlib.sha256()
    module = trainer.module
    tensors = [p for _, p in module.named_parameters()] if sharded else list(module.state_dict().values())
    for t in tensors:
        h.update(_local(t).detach().cpu().numpy().tobytes())
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(_local(v).detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-url", default=os.environ.get(worker_env.CHECKPOINT_URL))
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-rule", default="linear")
    p.add_argument("--base-world", type=int, default=4)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=32, help="the MLP's width")
    p.add_argument("--depth", type=int, default=0, help="hidden x hidden layers between the first and the last")
    p.add_argument("--keep-last", type=int, default=100)
    p.add_argument("--local-every", type=int, default=0, help="node-local snapshot every N steps (0: off)")
    p.add_argument(
        "--local-max-overhead",
        type=float,
        default=None,
        help="cap on the local snapshots' cost, a fraction of time (0: none)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds after SIGTERM to reach a step boundary, else exit unsaved; 0: wait",
    )
    p.add_argument(
        "--recovery",
        default=None,
        choices=[r.value for r in RecoveryMode],
        help="default: live under a live rendezvous (--rdzv-conf recovery=live), else restart",
    )
    p.add_argument("--live-ttl", type=float, default=3.0, help="live mode: each worker's lease, seconds")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2's fully_shard")
    p.add_argument(
        "--hsdp-shard",
        type=int,
        default=0,
        help="with --fsdp: HSDP, replicas of this many shards each (a 2-D mesh); 0: one shard per rank",
    )
    p.add_argument(
        "--parallelize",
        action="store_true",
        help="with --fsdp: hand the trainer the unsharded MLP and parallelize= (it shards it for each "
        "world; live mode needs this)",
    )
    p.add_argument(
        "--shard-size", type=int, default=0, help="with --parallelize: ranks per replica (0: the node's workers)"
    )
    p.add_argument("--max-steps", type=int, default=0, help="stop once this step is committed (0: run the epochs)")
    p.add_argument("--dump-steps", default="", help="comma-separated steps at which rank 0 dumps the full state")
    p.add_argument("--dump-start", action="store_true", help="rank 0 dumps the full state right after the restore")
    p.add_argument("--hold-file", type=Path, default=None, help="see the module docstring")
    p.add_argument("--hold-epoch", type=int, default=0, help="with --hold-file: the epoch from which steps wait")
    p.add_argument("--hold-max", type=float, default=0.0, help="with --hold-file: one step's wait at most (0: none)")
    p.add_argument("--pace-file", type=Path, default=None, help="--step-sleep only while this file exists")
    p.add_argument(
        "--wait-local",
        action="store_true",
        help="each step waits for the node-local snapshot of the step before (see above)",
    )
    args = p.parse_args(argv)
    if not args.checkpoint_url:
        p.error("--checkpoint-url (or $ETRAIN_CHECKPOINT_URL) is required")
    torch.set_num_threads(1)
    args.record.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get(worker_env.TORCHRUN_RESTART_COUNT, "0"))
    # One worker group (one rendezvous round) = one attempt; its master port is chosen anew each round.
    master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    attempt = f"{master}:{os.environ.get(worker_env.TORCHRUN_WORLD_SIZE)}"
    dataset = make_dataset(args.samples)
    model = make_model(args.seed, args.dropout, args.hidden, args.depth)
    if args.fsdp and not args.parallelize:
        model = _shard(model, args.hsdp_shard)  # before the optimizer: fully_shard replaces the parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    policy = LRPolicy(LRRule(args.lr_rule), args.lr, args.base_world, args.batch, warmup_steps=args.warmup)
    cap = ElasticConfig.local_max_overhead if args.local_max_overhead is None else args.local_max_overhead or None
    config = ElasticConfig(
        policy,
        args.checkpoint_url,
        checkpoint_options=CheckpointOptions(keep_last=args.keep_last),
        save_every_steps=args.save_every,
        local_every_steps=args.local_every or None,
        local_max_overhead=cap,
        seed=args.seed,
        progress_every=0,
        stop_timeout=timedelta(seconds=args.stop_timeout) if args.stop_timeout > 0 else None,
        recovery=RecoveryMode(args.recovery) if args.recovery else None,
        live=LiveOptions(ttl=timedelta(seconds=args.live_ttl)),
        shard_size=args.shard_size or None,
    )
    log_file: list[Path] = []
    resumed_from: list[str | None] = []
    trained: list[ElasticTrainer] = []

    def on_step(info: StepInfo) -> None:
        shard_size = trained[0].shard_size if trained else None
        record = {
            "step": info.step,
            "epoch": info.epoch,
            "rank": info.rank,
            "world": info.world_size,
            "lr": info.lr,
            "indices": list(info.indices),
            "restart": restart,
            "t": time.time(),
            "attempt": attempt if info.generation is None else f"gen{info.generation}",
            "gen": info.generation,
            "late": info.late,
            "pid": os.getpid(),
            "agent": os.environ.get("TEST_AGENT_NAME"),
            "digest": _digest(trained[0], args.parallelize) if trained else None,
            "shard": info.rank % shard_size if shard_size else None,
            "resumed_from": resumed_from[0] if resumed_from else None,
        }
        with open(log_file[0], "a") as f:
            f.write(json.dumps(record) + "\n")
        if args.step_sleep and (args.pace_file is None or args.pace_file.exists()):
            time.sleep(args.step_sleep)
        if args.hold_file is not None and info.epoch >= args.hold_epoch and not info.late:
            hold(args.hold_file, args.hold_max)
        if args.wait_local and trained:
            wait_local(trained[0])

    terminated: list[int] = []  # a SIGTERM came; no lock: the handler may run inside itself (a second signal)

    def hold(path: Path, most: float) -> None:
        deadline = time.monotonic() + most if most > 0 else None
        while path.exists() and not terminated and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)

    def wait_local(trainer: ElasticTrainer) -> None:
        deadline = time.monotonic() + 60  # a write that never ends is the loop's to report, not this wait's
        while trainer.local_snapshot_in_flight and not terminated and time.monotonic() < deadline:
            time.sleep(0.005)

    trainer = ElasticTrainer(
        model, optimizer, dataset, config, on_step=on_step, parallelize=parallelize if args.parallelize else None
    )
    trainers_handler = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:  # ends a hold; the trainer's handler does the rest
        terminated.append(signum)
        if callable(trainers_handler):
            trainers_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    trained.append(trainer)
    log_file.append(args.record / f"rank{trainer.rank}.{os.getpid()}.jsonl")
    resumed_from.append(trainer.resumed_from)

    def dump(name: str) -> None:
        state = full_state(trainer)  # every rank: a collective
        if trainer.rank == 0:
            torch.save(state, args.record / f"{name}.pt")

    if args.dump_start:
        dump("dump-start")
    dump_steps = {int(s) for s in args.dump_steps.split(",") if s}
    dumped = -1
    for x, y in trainer.batches(epochs=args.epochs):
        if trainer.step in dump_steps and trainer.step != dumped:
            dump(f"dump-step{trainer.step}")
            dumped = trainer.step
        if args.max_steps and trainer.step >= args.max_steps:
            break
        trainer.backward(F.cross_entropy(trainer.model(x), y))
    params = _module_state(trainer, args.fsdp)  # FSDP: gathered to rank 0 (a collective)
    if trainer.rank == 0 or args.fsdp:  # a sharded forward is a collective: every rank runs it
        module = trainer.module
        module.eval()
        with torch.no_grad():
            x_all, y_all = dataset.tensors
            loss = float(F.cross_entropy(module(x_all), y_all))
    if trainer.rank == 0:
        torch.save(params, args.record / "final_params.pt")
        (args.record / "final.json").write_text(json.dumps({"loss": loss, "step": trainer.step}))
    if not args.fsdp:
        torch.save(params, args.record / f"final_params.rank{trainer.rank}.pt")
    done = {
        "attempt": attempt,
        "step": trainer.step,
        "world": trainer.world_size,
        "pid": os.getpid(),
        "gen": trainer.generation,
    }
    (args.record / f"final.rank{trainer.rank}.json").write_text(json.dumps(done))
    trainer.close()
    return 0


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    sys.exit(main())
