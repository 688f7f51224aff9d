"""Which gradients travel together: the bucket assignment of live mode's all-reduce (pure, no collective).

As DDP does it (``compute_bucket_assignment_by_size`` with DDP's default sizes): parameters in *reverse*
order (the backward pass produces the last layers' gradients first), one open bucket per (dtype, device), the
first bucket closed once it holds ``first`` bytes (1 MiB: the first all-reduce starts early in the backward
pass), the others at ``limit`` (25 MiB), and the buckets ordered by their first parameter. Every rank computes the same
assignment from the same module structure, so launching buckets in index order keeps every rank's
collectives in the same order, whatever order the gradients arrive in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "assign_buckets"]

#: Gradients are all-reduced in buckets of about this many bytes (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20
#: ... but the first bucket of each (dtype, device) closes at this many (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class Bucket:
    """Parameters (by position in the list given to :func:`assign_buckets`) whose gradients are flattened
    into one buffer of ``numel`` elements, parameter ``params[i]`` at ``offsets[i]``."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device


def assign_buckets(
    params: Sequence[torch.Tensor], limit: int = BUCKET_BYTES, first: int | None = FIRST_BUCKET_BYTES
) -> list[Bucket]:
    """The buckets of ``params`` (see the module docstring); ``limit`` and ``first`` in bytes (``first=None``:
    ``limit`` for the first bucket too; at least one parameter per bucket, so a parameter larger than the
    limit has a bucket of its own)."""
    first = limit if first is None else min(first, limit)
    if first <= 0:
        raise ValueError(f"the bucket size must be positive, not {min(first, limit)}")
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    started: set[tuple[torch.dtype, torch.device]] = set()  # (dtype, device) whose first bucket closed
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        members = open_.setdefault(key, [])
        members.append(i)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        if sizes[key] >= (limit if key in started else first):
            started.add(key)
            closed.append(members)
            del open_[key]
            sizes[key] = 0
    closed.extend(m for m in open_.values() if m)
    closed.sort(key=lambda members: -members[0])  # by first parameter, in reverse order: as launched
    buckets = []
    for members in closed:
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        lead = params[members[0]]
        buckets.append(Bucket(tuple(members), tuple(offsets), total, lead.dtype, lead.device))
    return buckets
