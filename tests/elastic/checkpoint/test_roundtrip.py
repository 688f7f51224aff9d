"""Every state item survives save + load bit-identically, and a restored run continues exactly."""

from __future__ import annotations

import copy
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from elastic.checkpoint import (
    CheckpointOptions,
    TrainingState,
    capture_training_state,
    create_checkpoint_manager,
    restore_training_state,
)
from tests.elastic.checkpoint._helpers import assert_same, make_state
from tests.elastic.checkpoint.conftest import Target


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=100)
    return model, optimizer, scheduler


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[Any]:
    """Steps that consume torch, numpy and python randomness; returns what a continuation must reproduce."""
    seen: list[Any] = []
    for _ in range(steps):
        x = torch.randn(8, 16) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        seen.append((loss.item(), np.random.randint(1 << 30), random.getrandbits(64), torch.rand(3).tolist()))
    return seen


def snapshot_values(state: TrainingState) -> dict[str, Any]:
    """A deep copy of the captured state (capture returns live references)."""
    return copy.deepcopy(state.to_dict())


@pytest.mark.timeout(120)
def test_training_state_round_trips_bit_identically_and_training_continues_exactly(target: Target) -> None:
    np.random.seed(7)
    random.seed(7)
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 3)
    extras = {
        "ema": torch.randn(4, 4).to(torch.bfloat16),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "nan": float("nan"),
        "nested": {"ids": [1, 2, (3, "x")], "note": None},
    }
    state = capture_training_state(
        3,
        model,
        optimizer,
        scheduler,
        data_cursor={"epoch": 1, "position": 96, "seed": 11},
        lr_reference={"base_lr": 1e-2, "world_size": 4, "batch_size": 8},
        extras=extras,
    )
    expected = snapshot_values(state)
    options = CheckpointOptions(storage_options=target.storage_options)
    with create_checkpoint_manager(target.url, options) as mgr:
        mgr.check_storage()
        mgr.save(3, state, blocking=False)
        mgr.wait()
    uninterrupted = train(model, optimizer, scheduler, 4)
    final_params = copy.deepcopy(model.state_dict())

    np.random.seed(99)
    random.seed(99)
    model2, optimizer2, scheduler2 = build(seed=2)
    with create_checkpoint_manager(target.url, options) as mgr:
        snap = mgr.load_latest()
    assert snap is not None and snap.step == 3
    assert_same(snap.state, expected)
    assert snap.training_state().step == 3
    restored = restore_training_state(snap.state, model2, optimizer2, scheduler2)
    assert restored.data_cursor == {"epoch": 1, "position": 96, "seed": 11}
    assert restored.lr_reference == {"base_lr": 1e-2, "world_size": 4, "batch_size": 8}
    assert restored.world_size == 1 and snap.manifest.world_size == 1
    assert train(model2, optimizer2, scheduler2, 4) == uninterrupted
    assert_same(model2.state_dict(), final_params)


@pytest.mark.parametrize("url_form", ["memory", "file"])
def test_blocking_save_round_trips_on_memory_and_file_urls(url_form: str, tmp_path: Path) -> None:
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/job" if url_form == "memory" else f"file://{tmp_path}/ckpt"
    state = make_state(5)
    state["model"]["tied"] = state["model"]["weight"]  # shared tensors stay shared
    with create_checkpoint_manager(url) as mgr:
        mgr.check_storage()
        mgr.save(5, state, blocking=True)
        assert not mgr.in_flight and mgr.latest_step() == 5
        snap = mgr.load_latest()
    assert snap is not None
    assert_same(snap.state, state)
    assert snap.state["model"]["tied"] is snap.state["model"]["weight"]
    if url_form == "file":
        assert (tmp_path / "ckpt" / "step-000000000005" / "manifest.json").is_file()
