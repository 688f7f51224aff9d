"""A rank's micro-batch: the samples the sampler handed out, collated, on the training device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["make_batch", "to_device"]


def make_batch(dataset: Any, indices: Sequence[int], collate: Callable[[list[Any]], Any], device: torch.device) -> Any:
    """``collate`` of ``dataset[i]`` for each index, moved to ``device``."""
    return to_device(collate([dataset[i] for i in indices]), device)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device``: tensors, and tensors in lists, tuples and dicts (non-blocking); anything else and
    any batch for the CPU as it is."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
