"""BoundaryFlags: one rank's view of a step boundary, named, and the group's after one MAX all-reduce."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from elastic.train.boundary import BoundaryFlags


@pytest.mark.timeout(10)
def test_flags_travel_as_ints_in_field_order_and_come_back_named() -> None:
    flags = BoundaryFlags(time_due=True, writer_busy=True, joiners=True)
    assert flags.encode() == [1, 0, 0, 1, 1]
    assert BoundaryFlags.decode(flags.encode()) == flags
    assert BoundaryFlags.decode([0, 2, 0, 0, 0]) == BoundaryFlags(signalled=True)


@pytest.mark.timeout(10)
def test_a_wrong_number_of_flags_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="4 boundary flags, expected 5"):
        BoundaryFlags.decode([0, 0, 0, 0])


@pytest.fixture
def gloo_world_1() -> Iterator[None]:
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(30)
def test_agree_is_the_groups_view(gloo_world_1: None) -> None:
    mine = BoundaryFlags(signalled=True, local_due=True)
    assert mine.agree(torch.device("cpu")) == mine
