"""What every rank agrees on at a step boundary: :class:`BoundaryFlags`, one all-reduce per step.

Each rank states its own view (a snapshot falling due by time, a SIGTERM it saw, ...); :meth:`BoundaryFlags.agree`
MAX-reduces the views over the group, so that every rank takes the same decisions after it (the same
snapshots, the same stop, the same admission of joiners): a decision taken on one rank's view alone would
leave the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BoundaryFlags"]


@dataclass(frozen=True)
class BoundaryFlags:
    """One rank's view of a step boundary, or (after :meth:`agree`) the group's: each flag set on any rank."""

    time_due: bool = False  # a time-based snapshot is due (``save_every``)
    signalled: bool = False  # a rank saw SIGTERM: everyone saves this step synchronously, the signalled exit
    local_due: bool = False  # a node-local snapshot is due (rank 0's measurements decide)
    writer_busy: bool = False  # a writer is still saving the previous snapshot (non-writers report False)
    joiners: bool = False  # live recovery: workers wait to be admitted at this boundary
    # the optimizer steps of the loop step that ends here: the most on any rank, and minus the fewest (a MAX of
    # the negated count is the MIN): they differ when a step ran on some ranks only
    optimizer_steps: int = 0
    optimizer_steps_neg: int = 0

    @property
    def steps_agree(self) -> bool:
        """Every rank ran as many optimizer steps (after :meth:`agree`)."""
        return self.optimizer_steps == -self.optimizer_steps_neg

    def with_steps(self, stepped: int, *, joiners: bool) -> BoundaryFlags:
        """These flags with this rank's optimizer steps of the loop step (``stepped``) and whether (live) workers
        wait to be admitted."""
        return replace(self, optimizer_steps=stepped, optimizer_steps_neg=-stepped, joiners=joiners)

    def encode(self) -> list[int]:
        return [int(getattr(self, name)) for name in _NAMES]

    @classmethod
    def decode(cls, values: Sequence[int]) -> BoundaryFlags:
        names = _NAMES
        if len(values) != len(names):
            raise ValueError(f"{len(values)} boundary flags, expected {len(names)} ({', '.join(names)})")
        decoded: dict[str, Any] = {n: int(v) if n in _COUNTS else bool(v) for n, v in zip(names, values, strict=True)}
        return cls(**decoded)

    def agree(self, device: torch.device, group: Any = None) -> BoundaryFlags:
        """The group's flags: every rank's, MAX-reduced over ``group`` (None: the default one) on ``device``
        (a collective: every rank calls it at the boundary).  A group of one has nobody to agree with."""
        if dist.get_world_size(group) == 1:
            return self
        t = torch.tensor(self.encode(), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return BoundaryFlags.decode([int(v) for v in t.tolist()])


_NAMES = tuple(f.name for f in fields(BoundaryFlags))  # the wire order
_COUNTS = frozenset({"optimizer_steps", "optimizer_steps_neg"})
