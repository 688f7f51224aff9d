"""The training loader of :class:`~elastic.integrations.lightning.ElasticDDPStrategy`: the script's ``DataLoader``
rebuilt over the loop's :class:`~elastic.train.batch_sampler.ElasticBatchSampler` (its workers, pinned memory,
``collate_fn`` and prefetch kept), once nothing in it conflicts with the elastic sampler (a batch sampler or a
sampler of its own, an ``IterableDataset``, another micro-batch size, another data set than the snapshot's); and the
cursor whose sampler is made when that loader is known."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from elastic.checkpoint.state import TrainingState
from elastic.train.batch_sampler import ElasticBatchSampler
from elastic.train.cursor import TrainingCursor
from elastic.train.sampler import ElasticSampler

__all__ = ["ElasticLoader", "LoaderCursor", "elastic_loader"]


class LoaderCursor(TrainingCursor):
    """The training cursor, whose sampler is made when the training loader is known (Lightning requests it after
    the restore): a restored cursor's sampler is rebuilt from the snapshot's (its size, seed and order)."""

    def load(self, ts: TrainingState, rank: int, world_size: int) -> None:
        state = dict(dict(ts.data_cursor)["sampler"])
        self.sampler = ElasticSampler(
            int(state["dataset_size"]),
            seed=int(state["seed"]),
            shuffle=bool(state.get("shuffle", True)),
            replacement=bool(state.get("replacement", False)),
            num_samples=state.get("num_samples"),
        )
        super().load(ts, rank, world_size)


class ElasticLoader(DataLoader[Any]):
    """The user's loader over the elastic batch sampler. Its iterators are made without touching the global torch
    RNG (a DataLoader iterator draws its workers' base seed from it, and a resumed run makes its iterators at other
    points than an uninterrupted one: what the script drew after them would differ)."""

    def __iter__(self) -> _BaseDataLoaderIter:
        with torch.random.fork_rng(devices=[]):
            return super().__iter__()


def elastic_loader(
    dl: object, cursor: TrainingCursor, seed: int, rank: int, world_size: int, *, fresh: bool
) -> tuple[DataLoader[Any], ElasticBatchSampler]:
    """The training loader ``dl`` rebuilt over an elastic batch sampler bound to ``cursor`` (``fresh``: no snapshot
    was restored, so the cursor's sampler is made for ``dl``'s data set, with ``seed``, at ``rank`` of
    ``world_size``), and that batch sampler. Raises ``TypeError``/``ValueError`` naming what conflicts."""
    if not isinstance(dl, DataLoader):
        raise TypeError(f"ElasticDDPStrategy trains from a torch DataLoader, not a {type(dl).__name__}")
    if isinstance(dl.dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            "an IterableDataset has no indices for the elastic sampler: use a map-style data set "
            "(shards or windows) for exactly-once data across resizes"
        )
    if dl.batch_sampler is None or type(dl.batch_sampler) is not torch.utils.data.BatchSampler:
        raise TypeError(
            f"the training DataLoader has a batch sampler of its own ({type(dl.batch_sampler).__name__}"
            "): give it batch_size= (the LR policy's base_batch_per_worker), the elastic sampler "
            "decides which samples each step takes"
        )
    sampler = dl.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler) or (
        isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None)
    ):
        raise TypeError(
            f"the training DataLoader's sampler is a {type(sampler).__name__}: the elastic sampler "
            "replaces it (a random or sequential order only)"
        )
    shuffle = not isinstance(sampler, SequentialSampler) and bool(getattr(sampler, "shuffle", True))
    micro = cursor.policy.base_batch_per_worker
    if dl.batch_size != micro:
        raise ValueError(
            f"the training DataLoader's batch_size={dl.batch_size} differs from the LR policy's "
            f"base_batch_per_worker={micro}: the policy sets the micro-batch"
        )
    size = len(dl.dataset)  # type: ignore[arg-type]
    if fresh:
        if cursor.sampler.dataset_size != size:
            cursor.sampler = ElasticSampler(size, seed=seed, shuffle=shuffle)
            cursor.sampler.set_world(rank, world_size)
    elif cursor.sampler.dataset_size != size or cursor.sampler.shuffle != shuffle:
        raise ValueError(
            f"the snapshot's data cursor is for {cursor.sampler.dataset_size} samples "
            f"(shuffle={cursor.sampler.shuffle}), the training DataLoader has {size} "
            f"(shuffle={shuffle})"
        )
    batch_sampler = ElasticBatchSampler(size, seed=cursor.sampler.seed, shuffle=shuffle)
    batch_sampler.bind(cursor.policy.step_plan, sampler=cursor.sampler)
    workers = dl.num_workers
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {
            "prefetch_factor": dl.prefetch_factor,
            "persistent_workers": dl.persistent_workers,
            "multiprocessing_context": dl.multiprocessing_context,
            "timeout": dl.timeout,
        }
    if dl.pin_memory_device:
        extra["pin_memory_device"] = dl.pin_memory_device
    if hasattr(dl, "in_order"):
        extra["in_order"] = dl.in_order
    loader = ElasticLoader(
        dl.dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        worker_init_fn=dl.worker_init_fn,
        generator=dl.generator,
        **extra,
    )
    return loader, batch_sampler
