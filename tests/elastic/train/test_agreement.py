"""When the ranks agree on a boundary's flags: at the boundary (live, sharded, a world of one) or overlapped with the
next step (DDP in restart mode), elastic/train/agreement.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import compat
from elastic.train.agreement import Agreed, DeferredAgreement, ImmediateAgreement, check_steps
from elastic.train.boundary import BoundaryFlags
from elastic.train.collectives import HostCollectives
from elastic.train.config import ElasticConfig
from elastic.train.step import StepMismatchError
from elastic.train.strategy_ddp import DDPStrategy
from tests.elastic.train.test_open_loop import _policy
from tests.ranks import start_ranks

CPU = torch.device("cpu")


def _deferred_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    agreement = DeferredAgreement(CPU, lambda: None)
    lines = [f"first boundary: {agreement.agreed(1, 1, lambda: BoundaryFlags())}"]
    if rank == 1:
        time.sleep(3.0)  # the slow rank: the other one must not wait for it at its boundary
    started = time.monotonic()
    steps = 1 + rank
    mine = BoundaryFlags(signalled=rank == 1, time_due=rank == 0, optimizer_steps=steps, optimizer_steps_neg=-steps)
    agreement.launch(1, 1 + rank, lambda: mine)
    lines.append(f"launch waited: {time.monotonic() - started < 1.5}")
    with pytest.raises(RuntimeError, match="the agreement of step 1 was never waited for"):
        agreement.launch(2, 1, lambda: BoundaryFlags())
    grads = torch.full((4,), float(rank + 1))  # the next step's gradient all-reduce, issued while it is in flight
    dist.all_reduce(grads)
    lines.append(f"gradients: {grads.tolist()}")
    agreed = agreement.agreed(2, 1, lambda: BoundaryFlags())
    lines.append(f"second boundary: {agreed}")
    lines.append(f"drained: {agreement.drain()}")
    Path(out, f"rank{rank}").write_text("\n".join(lines))
    compat.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_deferred_agreement_does_not_wait_for_a_slow_rank_and_is_read_at_the_next_boundary(tmp_path: Path) -> None:
    start_ranks(_deferred_rank, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    flags = BoundaryFlags(time_due=True, signalled=True, optimizer_steps=2, optimizer_steps_neg=-1)
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}").read_text().splitlines()
        assert lines == [
            "first boundary: None",
            "launch waited: True",
            "gradients: [3.0, 3.0, 3.0, 3.0]",
            f"second boundary: {Agreed(1, flags, 1 + rank)}",
            "drained: None",
        ], f"rank {rank}"


@pytest.mark.timeout(10)
def test_a_step_run_on_some_ranks_only_names_the_step_it_happened_in() -> None:
    check_steps(Agreed(4, BoundaryFlags(optimizer_steps=1, optimizer_steps_neg=-1), 1))
    check_steps(Agreed(4, BoundaryFlags(), 0))  # skipped on every rank
    with pytest.raises(StepMismatchError, match=r"step 4: the optimizer\(s\) stepped 0 time\(s\) .*\(this rank: 1\)"):
        check_steps(Agreed(4, BoundaryFlags(optimizer_steps=1, optimizer_steps_neg=0), 1))


@pytest.mark.timeout(30)
def test_ddp_defers_its_agreement_only_where_there_is_somebody_to_agree_with(gloo_world_1: None) -> None:
    host = HostCollectives.for_loop(CPU, ElasticConfig(_policy()).timeout, live=False)
    strategy = DDPStrategy(nn.Linear(2, 2), ElasticConfig(_policy()))
    assert isinstance(strategy.agreement(host, 2), DeferredAgreement)
    assert isinstance(strategy.agreement(host, 1), ImmediateAgreement)
    mine = BoundaryFlags(signalled=True)
    assert ImmediateAgreement(CPU, host.group).agreed(3, 1, lambda: mine) == Agreed(3, mine, 1)
