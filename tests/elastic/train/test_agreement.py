"""When the ranks agree on a boundary's flags: at the boundary (live, sharded, a world of one) or overlapped with the
next step (DDP in restart mode), elastic/train/agreement.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import compat
from elastic.train.agreement import (
    MAX_WINDOW,
    Agreed,
    DeferredAgreement,
    ImmediateAgreement,
    _window_for,
    check_steps,
)
from elastic.train.boundary import BoundaryFlags
from elastic.train.collectives import HostCollectives
from elastic.train.config import ElasticConfig
from elastic.train.step import StepMismatchError
from elastic.train.strategy_ddp import DDPStrategy
from tests.elastic.train.test_open_loop import _policy
from tests.ranks import start_ranks

CPU = torch.device("cpu")


def _two_ranks(fn: Callable[[int, str, str], None], tmp_path: Path) -> list[list[str]]:
    """Run ``fn(rank, store_path, out)`` on 2 gloo ranks; each rank's lines (:func:`_report`)."""
    start_ranks(fn, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    return [(tmp_path / f"rank{rank}").read_text().splitlines() for rank in (0, 1)]


def _report(out: str, rank: int, lines: list[str]) -> None:
    Path(out, f"rank{rank}").write_text("\n".join(lines))
    compat.destroy_process_group()


def _deferred_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    agreement = DeferredAgreement(CPU, lambda: None)
    lines = [f"first boundary: {agreement.agreed(1, 1 + rank, lambda at: BoundaryFlags(), needed=False)}"]
    if rank == 1:
        time.sleep(3.0)  # the slow rank: the other one must not wait for it at its boundary
    started = time.monotonic()
    mine = BoundaryFlags(signalled=rank == 1, time_due=rank == 0)
    agreement.launch(1, lambda at: mine if at == 2 else BoundaryFlags(), soon=False)
    lines.append(f"launch waited: {time.monotonic() - started < 1.5}")
    with pytest.raises(RuntimeError, match="the agreement of step 1 was never waited for"):
        agreement.launch(2, lambda at: BoundaryFlags(), soon=False)
    grads = torch.full((4,), float(rank + 1))  # the next step's gradient all-reduce, issued while it is in flight
    dist.all_reduce(grads)
    lines.append(f"gradients: {grads.tolist()}")
    agreed = agreement.agreed(2, 1, lambda at: BoundaryFlags(), needed=False)
    lines.append(f"second boundary: {agreed}")
    lines.append(f"drained: {agreement.drain()}")  # step 2 was not agreed on yet: it is, now
    lines.append(f"drained again: {agreement.drain()}")
    _report(out, rank, lines)


@pytest.mark.timeout(120)
def test_a_deferred_agreement_does_not_wait_for_a_slow_rank_and_is_read_at_the_next_boundary(tmp_path: Path) -> None:
    flags = BoundaryFlags(time_due=True, signalled=True, optimizer_steps=2, optimizer_steps_neg=-1)
    for rank, lines in enumerate(_two_ranks(_deferred_rank, tmp_path)):
        assert lines == [
            "first boundary: None",
            "launch waited: True",
            "gradients: [3.0, 3.0, 3.0, 3.0]",
            f"second boundary: {Agreed(1, flags, 1 + rank)}",
            f"drained: {Agreed(2, BoundaryFlags(optimizer_steps=1, optimizer_steps_neg=-1), 1)}",
            "drained again: None",
        ], f"rank {rank}"


def _windows_rank(rank: int, store_path: str, out: str) -> None:
    """50 boundaries of ~5 ms steps with a 10 s interval: once the step time is known, one agreement per
    MAX_WINDOW boundaries. ``soon`` at step 20 and ``needed`` at step 25 agree on those boundaries' flags. Rank 1
    skips its optimizer step at step 30 (inside a window) and at step 45 (after the last agreement: only the drain
    sees it)."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    agreement = DeferredAgreement(CPU, lambda: None, interval=timedelta(seconds=10))
    lines = []
    for step in range(1, 51):
        time.sleep(0.005)
        stepped = 0 if rank == 1 and step in (30, 45) else 1
        try:
            agreed = agreement.agreed(step, stepped, lambda at: BoundaryFlags(time_due=at == 25), needed=step == 25)
            if agreed is not None:
                check_steps(agreed)
                lines.append(f"{step}: agreed {agreed.step} time_due={agreed.flags.time_due} every={agreement.every}")
        except StepMismatchError as exc:
            lines.append(f"{step}: mismatch in {str(exc).split(':')[0]}")
        agreement.launch(step, lambda at: BoundaryFlags(), soon=step == 20)
    try:
        check_steps(agreement.drain() or Agreed(0, BoundaryFlags(), 0))
    except StepMismatchError as exc:
        lines.append(f"drain: mismatch in {str(exc).split(':')[0]}")
    _report(out, rank, lines)


@pytest.mark.timeout(120)
def test_a_deferred_agreement_covers_a_window_of_steps_and_still_names_a_mismatched_step(tmp_path: Path) -> None:
    for rank, lines in enumerate(_two_ranks(_windows_rank, tmp_path)):
        assert lines == [
            "2: agreed 1 time_due=False every=1",  # step 1's time is not known: a window of one boundary
            f"3: agreed 2 time_due=False every={MAX_WINDOW}",  # ~5 ms steps: then MAX_WINDOW boundaries
            "19: agreed 18 time_due=False every=16",  # the window 3-18
            "21: agreed 20 time_due=False every=16",  # `soon` at 20: the window 19-20 closed early
            "25: agreed 25 time_due=True every=16",  # `needed`, nothing in flight: agreed at once, on 25's view
            "42: mismatch in step 30",  # the window 26-41, started at 41
            "drain: mismatch in step 45",  # the window 42-50, agreed when the steps end
        ], f"rank {rank}"


@pytest.mark.timeout(10)
def test_the_window_follows_the_groups_slowest_step_up_to_its_bound() -> None:
    for interval, slowest_us, every in [(0.25, 0, 1), (0.25, 30_000, 8), (0.25, 300_000, 1), (0.25, 1, 16), (0, 1, 1)]:
        assert _window_for(interval, slowest_us) == every, (interval, slowest_us)


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
    assert ImmediateAgreement(CPU, host.group).agreed(3, 1, lambda at: mine, needed=False) == Agreed(3, mine, 1)


@pytest.mark.timeout(30)
def test_ddps_agreement_takes_the_configs_interval_and_a_negative_one_is_refused(gloo_world_1: None) -> None:
    with pytest.raises(ValueError, match="agreement_interval must be >= 0"):
        ElasticConfig(_policy(), agreement_interval=timedelta(seconds=-1))
    host = HostCollectives.for_loop(CPU, ElasticConfig(_policy()).timeout, live=False)
    config = ElasticConfig(_policy(), agreement_interval=timedelta(0))
    agreement = DDPStrategy(nn.Linear(2, 2), config).agreement(host, 2)
    assert isinstance(agreement, DeferredAgreement) and agreement.interval == timedelta(0)
