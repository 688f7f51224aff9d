"""Exactly-once data across resizes: a step-based elastic sampler whose cursor lives in the checkpoint.

Each epoch is one deterministic permutation of the dataset (``seed + epoch``). The cursor is the number of
samples of that permutation consumed by committed optimizer steps. A step takes the next ``global_batch``
samples of the permutation and splits them over the ranks in contiguous blocks whose sizes differ by at most
one (the last step of an epoch takes what is left; a rank may then get none). So after a resize, whatever
world resumes from a cursor partitions exactly the samples not yet consumed: none skipped, none repeated.

With ``replacement=True`` an epoch is ``num_samples`` indices drawn uniformly with replacement (random windows
of a token stream, as language-model scripts draw them) from a generator seeded with ``seed + epoch``: the
stream of draws depends on neither the world size nor the step the run resumed at, so a resume at any world
continues the same stream, and each draw is consumed once.

:func:`step_layout` is a step's split into this rank's micro-batches: the one rule both the loop and the
:class:`~elastic.train.batch_sampler.ElasticBatchSampler` (what a ``DataLoader`` iterates) follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ElasticSampler", "StepLayout", "split_sizes", "step_layout"]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass
class _Cursor:
    epoch: int = 0
    position: int = 0


class ElasticSampler:
    """Deterministic, resumable, world-size-independent partition of each epoch.

    Args:
        dataset_size: number of samples.
        seed: permutation seed (epoch ``e`` uses ``seed + e``).
        shuffle: permute each epoch (else dataset order).
        replacement: draw each epoch's indices uniformly with replacement (``shuffle`` is then moot).
        num_samples: with ``replacement``, the draws per epoch (default ``dataset_size``).
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        if dataset_size < 1:
            raise ValueError("dataset_size must be >= 1")
        if num_samples is not None and not replacement:
            raise ValueError("num_samples is for replacement=True (without it, an epoch is the data set)")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self._n = dataset_size
        self._seed = seed
        self._shuffle = shuffle
        self._replacement = replacement
        self._len = (num_samples or dataset_size) if replacement else dataset_size
        self._cursor = _Cursor()
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)  # the epoch's order: a tensor, not a list (see _permutation)
        self.rank = 0
        self.world_size = 1

    # -- world ---------------------------------------------------------------------------------------
    def set_world(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.rank, self.world_size = rank, world_size

    # -- cursor --------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def position(self) -> int:
        return self._cursor.position

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def dataset_size(self) -> int:
        return self._n

    @property
    def replacement(self) -> bool:
        return self._replacement

    @property
    def epoch_size(self) -> int:
        """Samples (draws, with replacement) per epoch."""
        return self._len

    def options(self) -> dict[str, Any]:
        """The keyword arguments that build an equal sampler (at epoch 0)."""
        out: dict[str, Any] = {"seed": self._seed, "shuffle": self._shuffle, "replacement": self._replacement}
        if self._replacement:
            out["num_samples"] = self._len
        return out

    def copy(self) -> ElasticSampler:
        """An independent sampler at this one's cursor and world (a read-ahead that never moves this one)."""
        other = ElasticSampler(self._n, **self.options())
        other._cursor = _Cursor(self._cursor.epoch, self._cursor.position)
        other.rank, other.world_size = self.rank, self.world_size
        other._perm_epoch, other._perm = self._perm_epoch, self._perm  # shared, never changed in place: no recompute
        return other

    def remaining(self) -> int:
        return self._len - self._cursor.position

    def state_dict(self) -> dict[str, Any]:
        out = {
            "epoch": self._cursor.epoch,
            "position": self._cursor.position,
            "seed": self._seed,
            "dataset_size": self._n,
            "shuffle": self._shuffle,
        }
        if self._replacement:
            out["replacement"], out["num_samples"] = True, self._len
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_size"]) != self._n or int(state["seed"]) != self._seed:
            raise ValueError(
                f"sampler state is for {state['dataset_size']} samples / seed {state['seed']}, "
                f"not {self._n} / {self._seed}"
            )
        stored = (bool(state.get("replacement", False)), int(state.get("num_samples", state["dataset_size"])))
        if stored != (self._replacement, self._len if self._replacement else int(state["dataset_size"])):
            raise ValueError(
                f"sampler state is for replacement={stored[0]} with {stored[1]} draws per epoch, not "
                f"replacement={self._replacement} with {self._len}"
            )
        position = int(state["position"])
        if not 0 <= position <= self._len:
            raise ValueError(f"sampler position {position} outside 0..{self._len}")
        self._cursor = _Cursor(epoch=int(state["epoch"]), position=position)

    # -- steps ---------------------------------------------------------------------------------------
    def _permutation(self) -> torch.Tensor:
        """The epoch's order, made once per epoch: an int64 tensor (8 bytes a sample), not a list of ints (~36 bytes
        a sample, and one object the garbage collector walks element by element: 10M samples cost a 100 ms pause at
        each collection of the generation the list is in)."""
        if self._perm_epoch != self._cursor.epoch:
            if self._replacement:
                g = torch.Generator().manual_seed(self._seed + self._cursor.epoch)
                self._perm = torch.randint(self._n, (self._len,), generator=g)
            elif self._shuffle:
                g = torch.Generator().manual_seed(self._seed + self._cursor.epoch)
                self._perm = torch.randperm(self._n, generator=g)
            else:
                self._perm = torch.arange(self._n)
            self._perm_epoch = self._cursor.epoch
        return self._perm

    def step_size(self, global_batch: int) -> int:
        """How many samples the next step consumes (all ranks together)."""
        if global_batch < 1:
            raise ValueError("global_batch must be >= 1")
        return min(global_batch, self.remaining())

    def step_indices(self, global_batch: int) -> list[int]:
        """This rank's samples for the next step (the cursor does not move until :meth:`advance`)."""
        take = self.step_size(global_batch)
        sizes = split_sizes(take, self.world_size)
        start = self._cursor.position + sum(sizes[: self.rank])
        if not self._shuffle and not self._replacement:  # the data set's order: no list of every index (a stream)
            return list(range(start, start + sizes[self.rank]))
        indices: list[int] = self._permutation()[start : start + sizes[self.rank]].tolist()
        return indices

    def advance(self, global_batch: int) -> bool:
        """Commit the step; returns True when it completed the epoch (the cursor moves to the next one)."""
        self._cursor.position += self.step_size(global_batch)
        if self._cursor.position >= self._len:
            self._cursor = _Cursor(epoch=self._cursor.epoch + 1, position=0)
            return True
        return False


@dataclass(frozen=True)
class StepLayout:
    """One optimizer step as this rank sees it: its samples, split into micro-batches."""

    indices: list[int]  # this rank's samples of the step
    micro: list[list[int]]  # them, split into the step's micro-batches (some may be empty)
    total: int  # samples of the step, all ranks together
    pad_index: int = 0  # what a rank feeds for an empty micro-batch (with weight 0): the data set's first

    def weight(self, j: int, world_size: int) -> float:
        """The loss factor of micro-batch ``j`` that makes the summed gradients, averaged over the ranks, the
        exact mean over the step's samples (0 for an empty micro-batch)."""
        return len(self.micro[j]) * world_size / self.total


def step_layout(sampler: ElasticSampler, global_batch: int, accumulation_steps: int) -> StepLayout:
    """The next step of ``sampler`` (at its cursor and world) for this rank, in ``accumulation_steps``
    micro-batches (sizes differing by at most one, larger first)."""
    mine = sampler.step_indices(global_batch)
    micro, offset = [], 0
    for size in split_sizes(len(mine), accumulation_steps):
        micro.append(mine[offset : offset + size])
        offset += size
    return StepLayout(list(mine), micro, sampler.step_size(global_batch))
