"""The elastic sampler as a torch ``BatchSampler``: the user's own ``DataLoader`` (workers, pinned memory,
prefetch, its ``collate_fn``) serves the loop's micro-batches, exactly once across resizes.

    batch_sampler = ElasticBatchSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=4, pin_memory=True,
                        persistent_workers=True, collate_fn=collate)
    trainer = ElasticTrainer(model, optimizer, loader, config)

Iterating it yields this rank's micro-batches (lists of indices) for the rest of the epoch, from the cursor of
the last *committed* step: a ``DataLoader`` prefetches some of them ahead, but the cursor moves only when a step
commits (:meth:`advance`, which the loop calls). A batch fetched and not consumed by a committed step is
therefore never counted: after a kill, a resize or a dropped step the loop makes a new iterator of the loader,
which starts again at the committed cursor (a ``persistent_workers`` loader drops its workers' prefetched
batches when it is re-iterated). The split of each step follows :func:`~elastic.train.sampler.step_layout`,
with the micro-batch size and count of the loop's LR policy (its ``base_batch_per_worker`` and step plan for
this world); a rank without samples in a micro-batch gets the data set's first sample, which the loop weighs 0.

Used alone (a loop of the user's own), give ``batch_size`` (the per-rank micro-batch), set the world with
:meth:`set_world` (default: the process group's), call :meth:`advance` after each optimizer step, and save
:meth:`state_dict` with the checkpoint.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler

from elastic.contract.lr import StepPlan
from elastic.train.sampler import ElasticSampler, step_layout

__all__ = ["ElasticBatchSampler", "LockstepError"]


class LockstepError(RuntimeError):
    """The loader served a micro-batch other than the one the loop expected (e.g. ``in_order=False``)."""


class ElasticBatchSampler(Sampler[list[int]]):
    """See the module docstring.

    Args:
        data_source: the data set (its ``len``) or its number of samples.
        batch_size: the per-rank micro-batch when used without the loop; under the loop the LR policy's
            ``base_batch_per_worker`` decides (a different value given here is an error).
        seed: the permutation seed (epoch ``e`` uses ``seed + e``).
        shuffle: permute each epoch (else the data set's order).
        replacement: draw indices uniformly with replacement (random windows), ``num_samples`` per epoch.
        num_samples: draws per epoch with ``replacement`` (default: the data set's size).
        accumulation_steps: micro-batches per rank and step, when used without the loop.
    """

    def __init__(
        self,
        data_source: Sized | int,
        batch_size: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        replacement: bool = False,
        num_samples: int | None = None,
        accumulation_steps: int = 1,
    ) -> None:
        size = data_source if isinstance(data_source, int) else len(data_source)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.sampler = ElasticSampler(
            size, seed=seed, shuffle=shuffle, replacement=replacement, num_samples=num_samples
        )
        self.batch_size = batch_size
        self._accumulation = accumulation_steps
        self._plan: Callable[[int], StepPlan] | None = None
        self._served: deque[list[int]] = deque()  # what the newest iterator yielded and nobody consumed yet
        if dist.is_available() and dist.is_initialized():
            self.sampler.set_world(dist.get_rank(), dist.get_world_size())

    # -- the loop's side -----------------------------------------------------------------------------
    def bind(self, plan: Callable[[int], StepPlan], sampler: ElasticSampler | None = None) -> None:
        """The loop takes over: ``plan(world_size)`` gives each step's batch; ``sampler`` (the loop's cursor, when it
        restored one) replaces this one's. A ``batch_size`` given that differs from the plan's is refused."""
        if self.batch_size is not None and self.batch_size != plan(1).micro_batch:
            raise ValueError(
                f"ElasticBatchSampler(batch_size={self.batch_size}) conflicts with the LR policy's "
                f"base_batch_per_worker={plan(1).micro_batch}: leave batch_size out under the loop, "
                "the policy sets the micro-batch"
            )
        self._plan = plan
        if sampler is not None:
            self.sampler = sampler

    def plan(self) -> StepPlan:
        """The step plan at the sampler's world size."""
        world = self.sampler.world_size
        if self._plan is not None:
            return self._plan(world)
        if self.batch_size is None:
            raise ValueError("ElasticBatchSampler without the loop needs batch_size")
        a = self._accumulation
        return StepPlan(global_batch=world * self.batch_size * a, accumulation_steps=a, micro_batch=self.batch_size)

    def consumed(self) -> list[int]:
        """The micro-batch (indices) that the loader's next batch holds: the oldest one served and not consumed."""
        if not self._served:
            raise LockstepError("the loader served a batch its ElasticBatchSampler did not yield")
        return self._served.popleft()

    # -- the sampler's side --------------------------------------------------------------------------
    def set_world(self, rank: int, world_size: int) -> None:
        self.sampler.set_world(rank, world_size)

    def advance(self) -> bool:
        """Commit one step at the current world (used alone; the loop commits through its cursor); True when
        it finished the epoch."""
        return self.sampler.advance(self.plan().global_batch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def _steps(self) -> Iterator[list[list[int]]]:
        ahead = self.sampler.copy()
        epoch = ahead.epoch
        while ahead.epoch == epoch and ahead.remaining() > 0:
            plan = self.plan()
            layout = step_layout(ahead, plan.global_batch, plan.accumulation_steps)
            yield [idx or [layout.pad_index] for idx in layout.micro]
            ahead.advance(plan.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        served: deque[list[int]] = deque()
        self._served = served  # an older iterator's unconsumed batches are void
        for micro in self._steps():
            for idx in micro:
                served.append(idx)
                yield idx

    def __len__(self) -> int:
        """Micro-batches left in this epoch at the current world: each step left yields the plan's
        ``accumulation_steps`` (an empty one padded), so no walk over the epoch."""
        plan = self.plan()
        steps = -(-self.sampler.remaining() // plan.global_batch)
        return steps * plan.accumulation_steps
