"""A small training loop for preemption tests.

argv: URL PROGRESS_FILE MODE
- ``train``: trains with a background save every 5 steps and writes the step to PROGRESS_FILE after each
  step; on SIGTERM it writes a final synchronous snapshot at the next step boundary, then
  ``final <step> <sha256 of the model parameters>`` to PROGRESS_FILE, and exits 0.
- ``exit``: starts one background save and returns from main without waiting or closing.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn

from elastic.checkpoint import CheckpointOptions, capture_training_state, create_checkpoint_manager
from elastic.train.preemption import PreemptionWatcher


def model_digest(state: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for key in sorted(state):
        hasher.update(key.encode())
        hasher.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def main() -> None:
    url, progress, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mgr = create_checkpoint_manager(url, CheckpointOptions(keep_last=2))
    mgr.check_storage()
    if mode == "exit":
        mgr.save(1, capture_training_state(1, model, optimizer))
        progress.write_text("returning")
        return
    watcher = PreemptionWatcher().install()
    step = 0
    while True:
        step += 1
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            mgr.save(step, capture_training_state(step, model, optimizer))
        state = capture_training_state(step, model, optimizer, extras={"preempted": watcher.requested})
        if watcher.final_save(mgr, step, state):
            progress.write_text(f"final {step} {model_digest(model.state_dict())}")
            sys.exit(0)
        progress.write_text(str(step))
        time.sleep(0.05)


if __name__ == "__main__":
    # no elastic.interpreter.freeze_at_exit() here: the "exit" mode tests a user script's own interpreter exit
    main()
