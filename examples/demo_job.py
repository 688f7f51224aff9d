"""The service demo's job: a small regression trained by the project's elastic loop (ElasticTrainer).

Run by the node agents under stock torchrun with ``--rdzv-backend=etcd-v3``. Everything elastic comes from
the loop: it resumes from the newest verified snapshot under ``ETRAIN_CHECKPOINT_URL``, rescales the LR by
the job's policy (``ETRAIN_LR_POLICY``, JSON from the job spec) when the world size changes, hands out
every sample exactly once per epoch, saves asynchronously every ``--checkpoint-every`` steps and reports
progress (step, world size, loss, committed checkpoint) to the service.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic import ElasticConfig, ElasticTrainer, LRPolicy, LRRule
from elastic.contract.env import WorkerEnv
from elastic.train.trainer import StepInfo

logger = logging.getLogger("demo_job")


def _policy(batch: int) -> LRPolicy:
    """The job's policy under the service; else (plain torchrun) linear from 0.02 at one worker."""
    job = WorkerEnv.from_environ().job
    return job.lr_policy if job is not None else LRPolicy(LRRule.LINEAR, 0.02, 1, batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="rank 0 exits with code 3 at this step")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s demo_job %(message)s")
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=gen)
    y = x @ (torch.arange(8, dtype=torch.float32) / 8) + 0.01 * torch.randn(4096, generator=gen)
    dataset = TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    policy = _policy(args.batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=policy.base_lr)
    config = ElasticConfig(policy, save_every_steps=args.checkpoint_every, total_steps=args.steps, progress_every=10)

    def pace(_: StepInfo) -> None:
        time.sleep(args.step_time)

    trainer = ElasticTrainer(model, optimizer, dataset, config, on_step=pace)
    logger.info("world size %d, resuming at step %d, lr %.5f", trainer.world_size, trainer.step, trainer.current_lr())
    for xb, yb in trainer.batches(epochs=1_000_000):
        if trainer.step >= args.steps:
            break
        if trainer.rank == 0 and trainer.step + 1 == args.fail_at_step:
            logger.error("failing on purpose at step %d", trainer.step + 1)
            return 3
        trainer.backward(F.mse_loss(trainer.model(xb).squeeze(1), yb))
    if trainer.step >= args.steps:
        trainer.save(blocking=True)  # the final state is the job's latest committed checkpoint
    logger.info("finished at step %d", trainer.step)
    trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
