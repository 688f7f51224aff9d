"""The character-level transformer of elastic_chargpt.py, sharded with FSDP2 (``fully_shard`` per block), elastic.

Plain torchrun (any number of workers; a world-size change reshards the last snapshot on load)::

    torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \
        --rdzv-id=fsdp examples/elastic_fsdp.py --checkpoint-url /tmp/ckpt/fsdp

``--shard-size N`` (N dividing the world size) makes it HSDP: world / N replicas, each sharded over N ranks (on
GPUs, N = the GPUs of a node: shards talk over NVLink, replicas across nodes). Under the service, submit it as
the entrypoint of a job (``etrain submit``, see examples/demo_job.yaml); the agent passes the checkpoint URL.
The loop's sharded snapshots and their rules: docs/checkpoints.md, "Sharded models (FSDP2) in the elastic loop".
"""

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import DATA, CharDataset, TinyTransformer, setup_logging
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic.contract.lr import LRPolicy
from elastic.train.trainer import ElasticConfig, ElasticTrainer

log = logging.getLogger("fsdp")


def mesh_of(shard_size: int) -> DeviceMesh:
    """FSDP over every rank (``shard_size`` 0), or HSDP: replicas x ``shard_size`` shards."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    if not shard_size or shard_size == world:
        return init_device_mesh(device, (world,))
    if world % shard_size:
        raise SystemExit(f"--shard-size {shard_size} does not divide the world size {world}")
    return init_device_mesh(device, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this step (0: run the epochs)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-rule", default="sqrt")
    parser.add_argument("--base-world", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=0, help="HSDP: ranks per replica (0: plain FSDP)")
    parser.add_argument("--checkpoint-url", default=None)
    parser.add_argument("--text", default=str(DATA / "tiny_shakespeare.txt"))
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dataset = CharDataset(Path(args.text))
    model = TinyTransformer(len(dataset.chars))  # the same initial weights on every rank (seeded)
    mesh = mesh_of(args.shard_size)
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)  # each transformer block a unit: its parameters gathered only while it runs
    fully_shard(model, mesh=mesh)  # the rest (embeddings, head) at the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after fully_shard: over the sharded parameters
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(dataset) // args.batch)
    policy = LRPolicy(args.lr_rule, args.lr, args.base_world, args.batch, warmup_steps=20)
    config = ElasticConfig(policy, args.checkpoint_url, save_every_steps=50, progress_every=20)
    trainer = ElasticTrainer(model, optimizer, dataset, config, scheduler=scheduler)
    log.info("world %d, mesh %s, resumed at step %d", trainer.world_size, tuple(mesh.shape), trainer.step)
    for x, y in trainer.batches(epochs=args.epochs):
        if args.max_steps and trainer.step >= args.max_steps:
            break  # at a step boundary on every rank: the step counts alike everywhere
        logits = trainer.model(x)
        trainer.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    log.info("done at step %d", trainer.step)
    trainer.close()


if __name__ == "__main__":
    main()
