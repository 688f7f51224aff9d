"""ElasticBatchSampler: a torch BatchSampler that serves micro-batches from the committed cursor, so that what a
DataLoader prefetched and no committed step consumed is served again; the with-replacement stream is the same
whatever the world size."""

from __future__ import annotations

import time

import pytest
from torch.utils.data import BatchSampler, DataLoader, Sampler

from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.batch_sampler import ElasticBatchSampler
from elastic.train.data import step_data
from elastic.train.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(30)


def test_it_is_a_torch_sampler_that_a_dataloader_takes_as_its_batch_sampler() -> None:
    bs = ElasticBatchSampler(10, batch_size=3, shuffle=False)
    assert isinstance(bs, Sampler)
    loader = DataLoader(list(range(10)), batch_sampler=bs)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(bs) == 4


def test_a_new_iterator_starts_at_the_committed_cursor_not_where_the_prefetch_got_to() -> None:
    bs = ElasticBatchSampler(12, batch_size=2, shuffle=False)
    bs.set_world(1, 2)  # rank 1 of 2: a step takes 4 samples, this rank the last 2
    it = iter(bs)
    ahead = [next(it) for _ in range(3)]  # prefetched three steps
    assert ahead == [[2, 3], [6, 7], [10, 11]]
    assert bs.advance() is False  # one step committed
    assert next(iter(bs)) == [6, 7], "the second step again: the prefetched ones were never committed"
    bs.set_world(0, 3)  # a resize: 3 ranks, 6 samples a step, from sample 4
    assert list(bs) == [[4, 5], [10]], "the last step splits the 2 samples left over 3 ranks"


def test_state_dict_round_trips_the_cursor_and_refuses_another_data_set() -> None:
    bs = ElasticBatchSampler(20, batch_size=4, seed=3)
    bs.advance()
    other = ElasticBatchSampler(20, batch_size=4, seed=3)
    other.load_state_dict(bs.state_dict())
    assert list(other) == list(bs)
    with pytest.raises(ValueError, match=r"for 20 samples .* not 21"):
        ElasticBatchSampler(21, batch_size=4, seed=3).load_state_dict(bs.state_dict())
    with pytest.raises(ValueError, match="replacement"):
        ElasticBatchSampler(20, batch_size=4, seed=3, replacement=True).load_state_dict(bs.state_dict())


def test_draws_with_replacement_are_one_stream_whatever_the_world_size_and_resume_point() -> None:
    def stream(worlds: list[int], steps_each: int) -> list[int]:
        s = ElasticSampler(50, seed=9, replacement=True, num_samples=40)
        out: list[int] = []
        for world in worlds:
            for _ in range(steps_each):
                for rank in range(world):
                    s.set_world(rank, world)
                    out.extend(s.step_indices(6))
                s.advance(6)
            state = s.state_dict()
            s = ElasticSampler(50, seed=9, replacement=True, num_samples=40)
            s.load_state_dict(state)  # a restart at the next world
        return out

    one = stream([1], 9)
    assert stream([2, 1, 3], 3) == one, "the same draws in the same order across resizes and restarts"
    assert len(set(one)) < len(one), "drawn with replacement: some index repeats"
    assert max(one) < 50 and min(one) >= 0


def test_num_samples_without_replacement_is_refused() -> None:
    with pytest.raises(ValueError, match="replacement"):
        ElasticBatchSampler(10, num_samples=5)


def test_under_the_loop_the_policy_sets_the_micro_batch_and_a_different_batch_size_is_refused() -> None:
    policy = LRPolicy(LRRule.LINEAR, 0.1, 1, 4, accumulation_steps=2)
    bs = ElasticBatchSampler(40, shuffle=False)
    bs.bind(policy.step_plan)
    assert list(bs)[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]], "a step: 2 micro-batches of 4"
    with pytest.raises(ValueError, match=r"batch_size=8\) conflicts .* base_batch_per_worker=4"):
        ElasticBatchSampler(40, batch_size=8).bind(policy.step_plan)


def test_a_dataloader_with_a_sampler_of_its_own_is_refused_naming_the_fix() -> None:
    data = list(range(10))
    with pytest.raises(ValueError, match=r"sampler of its own .*ElasticBatchSampler"):
        step_data(DataLoader(data, batch_size=2, shuffle=True), lambda b: b, device=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop_last=True conflicts"):
        step_data(DataLoader(data, batch_size=2, drop_last=True), lambda b: b, device=None)  # type: ignore[arg-type]
    own = BatchSampler(range(10), batch_size=2, drop_last=False)
    with pytest.raises(ValueError, match="sampler of its own"):
        step_data(DataLoader(data, batch_sampler=own), lambda b: b, device=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [{}, {"shuffle": False}, {"replacement": True, "num_samples": 30}])
def test_a_sampler_built_from_anothers_options_takes_its_state_and_names_the_same_samples(kind: dict) -> None:
    """What live recovery does to name a dead rank's samples of a step: before, a with-replacement sampler was rebuilt
    without replacement and its state refused (the survivor crashed)."""
    s = ElasticSampler(50, seed=4, **kind)
    s.advance(7)
    s.set_world(1, 3)
    twin = ElasticSampler(50, **s.options())
    twin.load_state_dict(s.state_dict())
    twin.set_world(1, 3)
    assert twin.step_indices(9) == s.step_indices(9)


@pytest.mark.parametrize(
    ("size", "world", "rank", "accumulation", "batch"), [(10, 1, 0, 1, 3), (23, 3, 2, 2, 2), (7, 4, 3, 3, 1)]
)
def test_its_length_is_the_micro_batches_its_iterator_yields(
    size: int, world: int, rank: int, accumulation: int, batch: int
) -> None:
    bs = ElasticBatchSampler(size, batch_size=batch, accumulation_steps=accumulation, seed=1)
    bs.set_world(rank, world)
    assert len(bs) == len(list(bs))
    bs.advance()
    assert len(bs) == len(list(bs)), "after a committed step"


def test_its_length_does_not_walk_the_epoch() -> None:
    bs = ElasticBatchSampler(10_000_000, batch_size=8)
    bs.set_world(0, 2)
    started = time.perf_counter()
    assert len(bs) == 625_000
    assert time.perf_counter() - started < 0.05, "a walk over 10M samples takes seconds"
