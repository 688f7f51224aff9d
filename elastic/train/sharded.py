"""Sharded models (FSDP2's ``fully_shard``) in the elastic loop: their snapshot layout and gradient accumulation.

A model the script sharded itself with ``fully_shard`` is trained as it is (no DDP wrap: DDP would try to
broadcast the shards as whole tensors). Its gradients are reduce-scattered by FSDP, averaged over the world,
so the data-parallel degree (the ranks consuming distinct samples) is the world size, as with DDP: the loss
scaling, the LR policy and the exactly-once sampler are the same.

Its snapshot uses the sharded layout (``StateLayout.SHARDED``: DCP under our manifest, see
:mod:`elastic.checkpoint.sharded`), as one mapping of three entries:

- ``model`` and ``optim``: ``torch.distributed.checkpoint.state_dict.get_state_dict`` of the module and the
  optimizer (DTensor shards, keyed by the parameters' canonical names), which DCP reshards on load into any
  world size;
- ``loop``: everything else the loop restores (step, scheduler, data cursor, every rank's RNG, world size,
  LR reference and ramp), as one ``torch.save`` blob (bytes): its keys (the RNG states are per rank) depend
  on the world that saved it, so it cannot be a DCP template entry of the world that loads it. Every rank
  holds the same blob; DCP writes one copy.

Restoring is a collective (every rank loads its shards): :func:`load_template` makes the mapping DCP loads
into, :func:`apply_loaded` sets the model and optimizer from it and returns the loop's state.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic import compat
from elastic.checkpoint.state import TrainingState, capture_training_state, restore_training_state

__all__ = [
    "LOOP_KEY",
    "MODEL_KEY",
    "OPTIM_KEY",
    "apply_loaded",
    "capture_sharded",
    "forget_optimizer_state",
    "gradient_sync_off",
    "load_template",
    "loop_state",
]

MODEL_KEY, OPTIM_KEY, LOOP_KEY = "model", "optim", "loop"


def capture_sharded(
    step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, **cursor: Any
) -> dict[str, Any]:
    """The snapshot of a sharded model (a collective: gathers every rank's RNG state). Model and optimizer
    entries reference the live shards (DCP copies them when it stages the save)."""
    model_sd, optim_sd = get_state_dict(module, optimizer)
    loop = capture_training_state(step, torch.nn.Module(), None, scheduler, **cursor).to_dict()
    buf = io.BytesIO()
    torch.save(loop, buf)
    return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd, LOOP_KEY: buf.getvalue()}


def load_template(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP loads a sharded snapshot into: this world's shards of the model and optimizer state.

    An optimizer without state yet gets it from ``get_state_dict`` (a step with zero gradients and a zero
    LR, torch's way): call :func:`forget_optimizer_state` when nothing was loaded after all."""
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd, LOOP_KEY: b""}


def forget_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the state :func:`load_template` created (a fresh start: the first step must find none, e.g. Adam's
    step count)."""
    optimizer.state.clear()


def loop_state(loaded: Mapping[str, Any]) -> TrainingState:
    """The loop's part of a loaded sharded snapshot (step, cursor, RNG, scheduler, ...); no model state."""
    blob = loaded[LOOP_KEY]
    if not isinstance(blob, (bytes, bytearray)) or not blob:
        raise ValueError(f"a sharded snapshot's {LOOP_KEY!r} entry must be a non-empty bytes blob")
    return TrainingState.from_dict(torch.load(io.BytesIO(bytes(blob)), weights_only=True))


def apply_loaded(
    loaded: Mapping[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainingState:
    """Set the model and optimizer from a loaded snapshot, restore the scheduler and this rank's RNG (rank 0's
    when the world changed size); returns the loop's state (cursor, step, LR reference)."""
    set_state_dict(
        module, optimizer, model_state_dict=dict(loaded[MODEL_KEY]), optim_state_dict=dict(loaded[OPTIM_KEY])
    )
    return restore_training_state(loop_state(loaded), None, None, scheduler)


@contextmanager
def gradient_sync_off(module: torch.nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: gradients of the micro-batches run inside accumulate unsharded, without a
    reduce-scatter; the next backward outside syncs them all."""
    sharded = compat.fsdp_modules(module)
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
