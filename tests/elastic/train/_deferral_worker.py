"""A small ElasticTrainer run whose checkpoint storage is slow, for the snapshot deferral tests.

Imported by tests/elastic/train/test_snapshots.py (one process, world size 1) and run under torchrun with two
ranks (argv: ROOT OUT_DIR STEPS DELAY_S): each rank writes OUT_DIR/rank<r>.json with the snapshot counters it
saw after every step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic.checkpoint import CheckpointOptions
from elastic.checkpoint.storage import LocalStorage
from elastic.contract.lr import LRPolicy, LRRule
from elastic.interpreter import freeze_at_exit
from elastic.train.trainer import ElasticConfig, ElasticTrainer, SnapshotStats, StepInfo, WriterBusy

BATCH = 4


class SlowStorage(LocalStorage):
    """A local directory whose commit (the manifest's ``publish``) takes ``delay`` seconds more, as on a slow
    shared filesystem; the start-up probe is not slowed."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def publish(self, rel: str, data: bytes) -> None:
        if not rel.startswith(".probe"):
            time.sleep(self.delay)
        super().publish(rel, data)


@dataclass
class Run:
    """What a run saw: per step, the model after it, the wall time since the previous step, and the counters
    after that step's boundary."""

    trainer: ElasticTrainer
    model: nn.Module
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    stats: dict[int, SnapshotStats] = field(default_factory=dict)
    exit_code: int | None = None  # SystemExit's code when the loop stopped on SIGTERM


def train(
    root: Path,
    steps: int,
    delay: float,
    mode: WriterBusy,
    *,
    every: int = 5,
    sigterm_at: int | None = None,
    local_every: int | None = None,
) -> Run:
    """``steps`` optimizer steps of about 10 ms (one epoch), a snapshot due every ``every``; with ``sigterm_at``
    this process gets a SIGTERM during that step; with ``local_every`` a node-local snapshot is due every that
    many steps (no cost cap). The trainer is left open."""
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    n = steps * BATCH * int(os.environ.get("WORLD_SIZE", "1"))  # linear rule: the global batch grows with the world
    data = TensorDataset(torch.randn(n, 8), torch.randint(0, 3, (n,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = ElasticConfig(
        LRPolicy(LRRule.LINEAR, 0.1, 1, BATCH),
        checkpoint_options=CheckpointOptions(keep_last=1000),
        save_every_steps=every,
        when_writer_busy=mode,
        progress_every=0,
        local_every_steps=local_every,
        local_max_overhead=None,
    )
    last = [time.monotonic()]
    holder: list[Run] = []

    def on_step(info: StepInfo) -> None:
        now = time.monotonic()
        run = holder[0]
        run.gaps.append(now - last[0])
        last[0] = now
        run.params[info.step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if info.step == sigterm_at:
            signal.raise_signal(signal.SIGTERM)
        time.sleep(0.01)

    trainer = ElasticTrainer(
        model, optimizer, data, config, on_step=on_step, checkpoint_storage=SlowStorage(root, delay)
    )
    run = Run(trainer, model)
    holder.append(run)
    last[0] = time.monotonic()
    try:
        for x, y in trainer.batches(epochs=1):
            run.stats[trainer.step] = trainer.snapshot_stats  # the previous step's boundary is done
            trainer.backward(F.cross_entropy(trainer.model(x), y))
    except SystemExit as exc:
        run.exit_code = int(exc.code or 0)
    run.stats[trainer.step] = trainer.snapshot_stats
    return run


def main() -> None:
    root, out, steps, delay = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    run = train(root, steps, delay, WriterBusy.DEFER)
    rank = run.trainer.rank
    seen = {
        str(step): [s.saved, s.deferred, s.skipped, s.pending_since, s.last_saved_step] for step, s in run.stats.items()
    }
    run.trainer.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "max_gap": max(run.gaps)}))


if __name__ == "__main__":
    freeze_at_exit()  # exit skips the collector's pass over torch's objects (elastic.interpreter)
    main()
