"""Where the loop's micro-batches come from: one :class:`StepData` per kind of source.

- :class:`CollatedData`: a map-style data set collated in the training process (``collate_fn`` of
  ``dataset[i]``), the short form for tutorials;
- :class:`LoaderData`: the user's own ``DataLoader`` over an
  :class:`~elastic.train.batch_sampler.ElasticBatchSampler` (workers, pinned memory, prefetch, ``collate_fn``);
- :class:`StreamData`: a streaming source (an ``IterableDataset``) through a loader with ``state_dict`` /
  ``load_state_dict`` (torchdata's ``StatefulDataLoader``); each rank's loader state is saved with the snapshot
  (:class:`StreamStates`).

A stream has no indices for the loop's sampler, so the loop cannot choose a step's samples: each rank's loader
yields what the data set gives that rank (the data set shards the stream by rank itself, as streaming data sets
do). What holds: **at the same world size a resume is exact** (each rank's loader resumes from its own state saved
at the committed step: no sample skipped or repeated); **across a resize it is not exactly-once**: ranks that
existed before resume their own streams, new ranks start theirs afresh, and the part of a lost rank's stream that it
had not consumed is not served by anyone (or, if the data set re-shards by world size, shards move between ranks:
what that means is the data set's). A dropped step in live mode loses the batches it had taken.

Both serve the micro-batches of a :class:`~elastic.train.sampler.StepLayout` that the loop computed, on the
training device. :meth:`StepData.reset` voids what was read ahead (after a resize, a restore or a dropped step):
the next step is served from the committed cursor.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from elastic.contract.lr import StepPlan
from elastic.train.batch_sampler import ElasticBatchSampler, LockstepError
from elastic.train.batching import make_batch, to_device
from elastic.train.registry import StateRegistry
from elastic.train.sampler import ElasticSampler, StepLayout

logger = logging.getLogger(__name__)

__all__ = [
    "CollatedData",
    "LoaderData",
    "StepData",
    "StreamData",
    "StreamStates",
    "is_stream",
    "source_sampler",
    "step_data",
]

#: the cursor's data set size for a stream: its sample numbers, never reached (a stream ends with ``max_steps``)
STREAM_SIZE = 2**62


class StepData(ABC):
    """The contract: :meth:`micro_batches` yields each micro-batch of ``layout`` (an empty one as the pad sample),
    collated and on the device, in order."""

    @abstractmethod
    def micro_batches(self, layout: StepLayout) -> Iterator[Any]: ...

    def bind(self, plan: Callable[[int], StepPlan], registry: StateRegistry) -> StepData:
        """Join the loop: a loader's :class:`ElasticBatchSampler` takes the policy's ``plan`` for each world, a
        stream's loader states join the snapshots (``registry``). Returns itself."""
        return self

    def reset(self) -> None:
        """What was read ahead is void: the next step is served from the committed cursor."""
        return None

    def close(self) -> None:
        """Release workers and buffers."""
        return None


class CollatedData(StepData):
    """``collate([dataset[i] for i in micro])`` in this process."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], device: torch.device) -> None:
        self._dataset, self._collate, self._device = dataset, collate, device

    def micro_batches(self, layout: StepLayout) -> Iterator[Any]:
        for idx in layout.micro:
            yield make_batch(self._dataset, idx or [layout.pad_index], self._collate, self._device)


class LoaderData(StepData):
    """The user's ``DataLoader``; checks that each batch it serves is the micro-batch the loop expects."""

    def __init__(self, loader: DataLoader[Any], device: torch.device) -> None:
        sampler = loader.batch_sampler
        assert isinstance(sampler, ElasticBatchSampler)
        self._loader, self._sampler, self._device = loader, sampler, device
        self._it: Iterator[Any] | None = None

    def bind(self, plan: Callable[[int], StepPlan], registry: StateRegistry) -> StepData:
        self._sampler.bind(plan)
        return self

    def micro_batches(self, layout: StepLayout) -> Iterator[Any]:
        for j, idx in enumerate(layout.micro):
            batch = self._next(first=j == 0)
            expected = idx or [layout.pad_index]
            served = self._sampler.consumed()
            if served != expected:
                self.reset()
                raise LockstepError(
                    f"the DataLoader served samples {served[:4]}... where the loop expected "
                    f"{expected[:4]}...: it must serve its batch sampler's batches in order "
                    "(in_order=True, the default)"
                )
            yield to_device(batch, self._device)

    def _next(self, first: bool) -> Any:
        if self._it is None:
            self._it = _iterate(self._loader)
        try:
            return next(self._it)
        except StopIteration:
            if not first:
                raise LockstepError("the DataLoader ended in the middle of a step") from None
        self._it = _iterate(self._loader)  # the epoch ended with the last step: the next one starts it again
        try:
            return next(self._it)
        except StopIteration:
            raise LockstepError("the DataLoader served nothing for a step the loop expected") from None

    def reset(self) -> None:
        self._it = None  # the next iter() starts at the committed cursor (persistent workers drop their prefetch)

    def close(self) -> None:
        self._it = None


class StreamStates:
    """Every rank's loader state, as one registered state (a :class:`~elastic.train.registry.Stateful`): the
    snapshot's writer saves them all. :meth:`gather` (a collective) collects them before a snapshot is captured;
    :meth:`load_state_dict` gives this rank its own state, or none (a rank the saved world did not have)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._gathered: dict[int, Any] = {}

    def gather(self, group: Any = None) -> None:
        import torch.distributed as dist

        mine = self._loader.state_dict()
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            self._gathered = {0: mine}
            return
        states: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, mine, group=group)
        self._gathered = dict(enumerate(states))

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": {str(rank): state for rank, state in self._gathered.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        ranks = state.get("ranks", {})
        if str(rank) in ranks:
            self._loader.load_state_dict(ranks[str(rank)])
        else:
            logger.warning(
                "the snapshot holds no stream state for rank %d (saved by %d ranks): this rank's stream starts afresh",
                rank,
                len(ranks),
            )


class StreamData(StepData):
    """A streaming loader: each micro-batch is the loader's next batch (the layout's indices are the stream's sample
    numbers, not the data set's); an epoch of the loader that ends starts the next one."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self._loader, self._device = loader, device
        self._it: Iterator[Any] | None = None
        self.states = StreamStates(loader)

    def bind(self, plan: Callable[[int], StepPlan], registry: StateRegistry) -> StepData:
        registry.register("stream", self.states)  # every rank's loader state, in the snapshots
        return self

    def micro_batches(self, layout: StepLayout) -> Iterator[Any]:
        for _ in layout.micro:
            if self._it is None:
                self._it = _iterate(self._loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = _iterate(self._loader)
                try:
                    batch = next(self._it)
                except StopIteration:
                    raise LockstepError("the stream served nothing for a step the loop expected") from None
            yield to_device(batch, self._device)

    def reset(self) -> None:
        """A stream is not re-split: the loader goes on (a restore loads its state into the loader first)."""
        self._it = None

    def close(self) -> None:
        self._it = None


def _iterate(loader: Any) -> Iterator[Any]:
    """A new iterator of ``loader``, made without touching the script's torch RNG: a DataLoader iterator draws its
    workers' base seed from the global generator, and a resumed run makes one more iterator than an uninterrupted
    one, so everything the script drew after it (dropout, noise) came out otherwise."""
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def is_stream(source: Any) -> bool:
    """A streaming source: a loader over an ``IterableDataset``, or any iterable with ``state_dict`` and
    ``load_state_dict`` that is not a DataLoader over an :class:`ElasticBatchSampler`."""
    if isinstance(source, DataLoader):
        return isinstance(source.dataset, torch.utils.data.IterableDataset)
    return (
        hasattr(source, "__iter__")
        and not hasattr(source, "__getitem__")
        and callable(getattr(source, "state_dict", None))
    )


def step_data(source: Any, collate: Callable[[list[Any]], Any], device: torch.device) -> StepData:
    """The :class:`StepData` for the trainer's ``data`` argument: a ``DataLoader`` over an
    :class:`ElasticBatchSampler`, or a map-style data set (collated in-process by ``collate``). A ``DataLoader``
    with a sampler of its own is refused (the loop must decide which samples each step takes)."""
    if is_stream(source):
        if not (callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))):
            raise ValueError(
                f"a streaming source must save its position: {type(source).__name__} has no state_dict/"
                "load_state_dict; wrap the IterableDataset in torchdata's StatefulDataLoader "
                "(pip install elastic-train[stream]); see docs/open-loop.md"
            )
        return StreamData(source, device)
    if isinstance(source, DataLoader):
        if not isinstance(source.batch_sampler, ElasticBatchSampler):
            hint = (
                " (its drop_last=True conflicts too: the loop's last step of an epoch takes what is left)"
                if (source.drop_last)
                else ""
            )
            raise ValueError(
                "the DataLoader has a sampler of its own "
                f"({type(source.batch_sampler).__name__} over {type(source.sampler).__name__}){hint}: build it "
                "with batch_sampler=ElasticBatchSampler(dataset) and no batch_size, shuffle, sampler or drop_last, "
                "so that the loop decides which samples each step takes (exactly once across resizes)"
            )
        if collate is not default_collate:
            raise ValueError("collate_fn= is for a data set; a DataLoader collates with its own collate_fn")
        return LoaderData(source, device)
    if isinstance(source, torch.utils.data.IterableDataset):
        raise ValueError(
            "an IterableDataset passed as data: pass a loader over it that saves its position "
            "(torchdata's StatefulDataLoader); see docs/open-loop.md, streaming sources"
        )
    if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
        raise TypeError(
            f"data must be a DataLoader over an ElasticBatchSampler or a map-style data set (with "
            f"__getitem__ and __len__), not {type(source).__name__}"
        )
    return CollatedData(source, collate, device)


def source_sampler(source: Any, seed: int, shuffle: bool) -> ElasticSampler:
    """The sampler whose position the loop's cursor saves: a loader's :class:`ElasticBatchSampler`'s own, one that
    counts a stream's samples (a stream's position is its loader's state), or one over a data set's indices."""
    batch_sampler = getattr(source, "batch_sampler", None)
    if isinstance(batch_sampler, ElasticBatchSampler):
        return batch_sampler.sampler
    if is_stream(source):
        return ElasticSampler(STREAM_SIZE, shuffle=False)
    return ElasticSampler(len(source), seed=seed, shuffle=shuffle)
