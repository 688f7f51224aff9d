"""Exactly-once data across resizes: a step-based elastic sampler whose cursor lives in the checkpoint.

Each epoch is one deterministic permutation of the dataset (``seed + epoch``). The cursor is the number of
samples of that permutation consumed by committed optimizer steps. A step takes the next ``global_batch``
samples of the permutation and splits them over the ranks in contiguous blocks whose sizes differ by at most
one (the last step of an epoch takes what is left; a rank may then get none). So after a resize, whatever
world resumes from a cursor partitions exactly the samples not yet consumed: none skipped, none repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ElasticSampler", "split_sizes"]


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
    """

    def __init__(self, dataset_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ValueError("dataset_size must be >= 1")
        self._n = dataset_size
        self._seed = seed
        self._shuffle = shuffle
        self._cursor = _Cursor()
        self._perm_epoch = -1
        self._perm: list[int] = []
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

    def remaining(self) -> int:
        return self._n - self._cursor.position

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._cursor.epoch, "position": self._cursor.position, "seed": self._seed,
                "dataset_size": self._n, "shuffle": self._shuffle}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_size"]) != self._n or int(state["seed"]) != self._seed:
            raise ValueError(
                f"sampler state is for {state['dataset_size']} samples / seed {state['seed']}, "
                f"not {self._n} / {self._seed}"
            )
        position = int(state["position"])
        if not 0 <= position <= self._n:
            raise ValueError(f"sampler position {position} outside 0..{self._n}")
        self._cursor = _Cursor(epoch=int(state["epoch"]), position=position)

    # -- steps ---------------------------------------------------------------------------------------
    def _permutation(self) -> list[int]:
        if self._perm_epoch != self._cursor.epoch:
            if self._shuffle:
                g = torch.Generator().manual_seed(self._seed + self._cursor.epoch)
                self._perm = torch.randperm(self._n, generator=g).tolist()
            else:
                self._perm = list(range(self._n))
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
        return self._permutation()[start : start + sizes[self.rank]]

    def advance(self, global_batch: int) -> bool:
        """Commit the step; returns True when it completed the epoch (the cursor moves to the next one)."""
        self._cursor.position += self.step_size(global_batch)
        if self._cursor.position >= self._n:
            self._cursor = _Cursor(epoch=self._cursor.epoch + 1, position=0)
            return True
        return False
