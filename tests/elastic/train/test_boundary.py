"""BoundaryFlags: one rank's view of a step boundary, named, and the group's after one MAX all-reduce."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elastic.train.boundary import BoundaryFlags


@pytest.mark.timeout(10)
def test_flags_travel_as_ints_in_field_order_and_come_back_named() -> None:
    flags = BoundaryFlags(time_due=True, writer_busy=True, joiners=True, optimizer_steps=2, optimizer_steps_neg=-2)
    assert flags.encode() == [1, 0, 0, 1, 1, 2, -2]
    assert BoundaryFlags.decode(flags.encode()) == flags
    assert BoundaryFlags.decode([0, 2, 0, 0, 0, 0, 0]) == BoundaryFlags(signalled=True)


@pytest.mark.timeout(10)
def test_optimizer_step_counts_agree_only_when_every_rank_ran_as_many() -> None:
    # after the MAX all-reduce: the most steps on any rank, and minus the fewest
    assert BoundaryFlags(optimizer_steps=1, optimizer_steps_neg=-1).steps_agree
    assert BoundaryFlags(optimizer_steps=0, optimizer_steps_neg=0).steps_agree  # skipped on every rank
    assert not BoundaryFlags(optimizer_steps=1, optimizer_steps_neg=0).steps_agree  # one rank skipped


@pytest.mark.timeout(10)
def test_a_wrong_number_of_flags_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="4 boundary flags, expected 7"):
        BoundaryFlags.decode([0, 0, 0, 0])


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.timeout(30)
def test_a_group_of_one_agrees_on_its_own_view_without_a_collective(gloo_world_1: None) -> None:
    mine = BoundaryFlags(signalled=True, local_due=True)
    with _Ops() as ops:
        assert mine.agree(torch.device("cpu")) == mine
    assert ops.seen == [], "a world of one has nobody to agree with: no tensor, no all-reduce"
    # two ranks MAX-reduce their flags: tests/elastic/train/test_host_sync.py (and every loop test under torchrun)
