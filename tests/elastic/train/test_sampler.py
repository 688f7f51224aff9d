"""Exactly-once sampling across resizes, pure (no processes)."""

from __future__ import annotations

import random

import pytest

from elastic.train.sampler import ElasticSampler, split_sizes


def _step_all(samplers: list[ElasticSampler], global_batch: int) -> list[int]:
    taken = [i for s in samplers for i in s.step_indices(global_batch)]
    for s in samplers:
        s.advance(global_batch)
    return taken


def _world(n: int, world: int, state: dict | None, seed: int = 7) -> list[ElasticSampler]:
    out = []
    for r in range(world):
        s = ElasticSampler(n, seed=seed)
        if state is not None:
            s.load_state_dict(state)
        s.set_world(r, world)
        out.append(s)
    return out


def test_split_sizes_differ_by_at_most_one() -> None:
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_index_once_per_epoch_across_random_resizes(seed: int) -> None:
    rng = random.Random(seed)
    n = 1000
    world = 4
    samplers = _world(n, world, None)
    seen: dict[int, list[int]] = {}
    while samplers[0].epoch < 3:
        epoch = samplers[0].epoch
        taken = _step_all(samplers, global_batch=8 * world)
        seen.setdefault(epoch, []).extend(taken)
        if rng.random() < 0.1:  # resize: a new world resumes from the committed cursor
            world = rng.choice([1, 2, 3, 4, 5])
            samplers = _world(n, world, samplers[0].state_dict())
    for epoch in range(3):
        assert sorted(seen[epoch]) == list(range(n)), f"epoch {epoch}"


def test_epochs_are_shuffled_differently_and_deterministically() -> None:
    a = ElasticSampler(50, seed=3)
    b = ElasticSampler(50, seed=3)
    e0 = a.step_indices(50)
    assert e0 == b.step_indices(50)
    a.advance(50)
    assert a.epoch == 1 and a.step_indices(50) != e0
    assert sorted(a.step_indices(50)) == sorted(e0)


def test_last_step_of_epoch_takes_the_remainder_and_some_ranks_may_get_none() -> None:
    samplers = _world(10, 4, None)
    _step_all(samplers, 8)
    sizes = [len(s.step_indices(8)) for s in samplers]
    assert sizes == [1, 1, 0, 0]


def test_state_for_another_dataset_is_refused() -> None:
    s = ElasticSampler(10, seed=1)
    with pytest.raises(ValueError, match="sampler state"):
        s.load_state_dict(ElasticSampler(11, seed=1).state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replacement", [False, True])
def test_a_large_epoch_order_costs_8_bytes_a_sample_and_nothing_the_collector_walks(replacement: bool) -> None:
    """The epoch's order is a tensor: a list of 2M ints would take ~72 MB and be one object whose 2M elements the
    garbage collector visits at each collection of its generation (a 100 ms pause at 10M samples, issue 52)."""
    import gc
    import tracemalloc

    import torch

    n = 2_000_000
    sampler = ElasticSampler(n, seed=3, replacement=replacement)
    sampler.set_world(1, 2)
    tracemalloc.start()
    try:
        first = sampler.step_indices(8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes of Python objects for the epoch's order of {n} samples"
    assert not any(isinstance(o, list) and len(o) >= n for o in gc.get_objects())
    g = torch.Generator().manual_seed(3)
    order = torch.randint(n, (n,), generator=g) if replacement else torch.randperm(n, generator=g)
    assert first == order[4:8].tolist()  # the same order as before: resumed runs read the same samples
