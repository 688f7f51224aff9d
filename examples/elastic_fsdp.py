"""The character-level transformer of elastic_chargpt.py, sharded with FSDP2 (``fully_shard`` per block), elastic.

Plain torchrun (any number of workers; a world-size change reshards the last snapshot on load)::

    torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \
        --rdzv-id=fsdp examples/elastic_fsdp.py --checkpoint-url /tmp/ckpt/fsdp

The script hands the trainer the unsharded model and ``parallelize``, which the trainer calls for each world on
a (replicate, shard) mesh: HSDP, world / N replicas each sharded over N ranks, N = ``--shard-size`` or by default
a node's workers (on GPUs: shards talk over NVLink, replicas across nodes; on one node that is plain FSDP). With
live recovery (``--rdzv-conf recovery=live``) a lost node takes one replica away, the other nodes' workers go on
in the same processes with their shards in place, and a joining node receives each shard from a replica::

    torchrun --max-restarts=3 --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \
        --rdzv-id=fsdp --rdzv-conf recovery=live examples/elastic_fsdp.py --checkpoint-url /tmp/ckpt/fsdp

Under the service, submit it as the entrypoint of a job (``etrain submit``, see examples/demo_job.yaml; the
job spec's ``recovery: live`` for live recovery); the agent passes the checkpoint URL. The loop's sharded
snapshots and their rules: docs/checkpoints.md, "Sharded models (FSDP2) in the elastic loop".
"""

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DATA, CharDataset, TinyTransformer, setup_logging
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from elastic.contract.lr import LRPolicy
from elastic.train.trainer import ElasticConfig, ElasticTrainer

log = logging.getLogger("fsdp")


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Each transformer block a unit (its parameters gathered only while it runs), the rest at the root."""
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this step (0: run the epochs)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-rule", default="sqrt")
    parser.add_argument("--base-world", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=0, help="HSDP: ranks per replica (0: a node's workers)")
    parser.add_argument("--save-every", type=int, default=50, help="a sharded snapshot every this many steps")
    parser.add_argument("--checkpoint-url", default=None)
    parser.add_argument("--text", default=str(DATA / "tiny_shakespeare.txt"))
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dataset = CharDataset(Path(args.text))
    model = TinyTransformer(len(dataset.chars))  # the same initial weights on every rank (seeded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # the trainer points it at each world's shards
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(dataset) // args.batch)
    policy = LRPolicy(args.lr_rule, args.lr, args.base_world, args.batch, warmup_steps=20)
    config = ElasticConfig(
        policy,
        args.checkpoint_url,
        save_every_steps=args.save_every,
        progress_every=20,
        shard_size=args.shard_size or None,
    )
    trainer = ElasticTrainer(model, optimizer, dataset, config, scheduler=scheduler, parallelize=parallelize)
    mesh = trainer.mesh
    assert mesh is not None
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
