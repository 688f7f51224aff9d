"""Data parallelism without DDP for live recovery: the gradients are all-reduced by the loop itself.

A DDP wrapper keeps a reference to its process group inside its reducer, which outlives the wrapper: a torn
down gloo group then keeps its connections open, and a peer blocked in a collective with this worker waits
until the collective timeout instead of failing at once (seen in the chaos suite: a member that committed a
step, left behind for 600 s by the others' re-form). So in live mode the model is wrapped in
:class:`LiveDataParallel`, which holds no process group: the backward pass computes local gradients only,
and :func:`all_reduce_gradients` averages them over the group at the step boundary, in buckets, one
collective each. Every collective of a step is then the loop's own, where a failure is caught. The cost: no
overlap of communication with the backward pass (DDP's buckets start while it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["BUCKET_BYTES", "LiveDataParallel", "all_reduce_gradients", "broadcast_module"]

#: Gradients are all-reduced in buckets of about this many bytes (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20


class LiveDataParallel(nn.Module):
    """The user's module for one generation of the live group (``.module`` as with DDP; ``no_sync`` is a
    no-op: gradients are all-reduced once per step anyway)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() * t.element_size() > limit or t.dtype != bucket[0].dtype
                       or t.device != bucket[0].device):  # fmt: skip
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def all_reduce_gradients(module: nn.Module, world_size: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average every trainable parameter's gradient over the group (a parameter without one, unused on this
    rank, takes part with zeros and gets the average). A collective: every rank calls it with the same
    module structure; the result is the same on every rank, bit for bit."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            g.copy_(reduced)


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers rank ``src``'s (as DDP's constructor does)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src)
