"""A rank's micro-batch: the samples the sampler handed out, collated, on the training device.

A tensor in pageable host memory is pinned before its copy to a GPU.  A ``non_blocking`` copy from pageable
memory is staged by the driver through buffers of its own, which "may synchronize with the stream" (CUDA's API
synchronization behaviour): for anything larger than those buffers the host then waits until the work already
queued (the previous step's backward pass and optimizer step) is done, and the GPU idles while the host collates
the next batch.  From pinned memory the copy is queued and the host goes on; torch's pinned-memory cache keeps the
block until the copy is done and then reuses it, so after the first batches nothing is allocated.  The host pays
one memory copy into the pinned block, the one the driver's staging made before.  This is what
``DataLoader(pin_memory=True)`` does; the loop collates the batches itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["make_batch", "to_device"]


def make_batch(dataset: Any, indices: Sequence[int], collate: Callable[[list[Any]], Any], device: torch.device) -> Any:
    """``collate`` of ``dataset[i]`` for each index, moved to ``device``."""
    return to_device(collate([dataset[i] for i in indices]), device)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device``: tensors, and tensors in lists, tuples, namedtuples and dicts (non-blocking; a host
    tensor bound for a GPU is pinned first: see the module docstring); anything else and any batch for the CPU as it
    is."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple, as ``default_collate`` keeps it
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
