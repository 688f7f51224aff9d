"""``with step:`` around the own-step form's body: in live mode a peer lost in a collective of the script's own (a
metric's all-reduce) drops the step as one lost in backward does; any other error, and every error in restart mode,
is raised (elastic/train/step.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic import compat
from elastic.live.group import is_peer_failure
from elastic.train.sampler import ElasticSampler, step_layout
from elastic.train.step import Step, StepHost
from tests.ranks import start_ranks


def _step(peer_lost: object) -> tuple[Step, list[str]]:
    seen: list[str] = []
    dropped: list[bool] = []

    def lost(exc: RuntimeError) -> bool:  # as the live strategy's peer_failed: a lost peer marks the step dropped
        seen.append(type(exc).__name__)
        if peer_lost(exc):  # type: ignore[operator]
            dropped.append(True)
        return bool(dropped)

    host = StepHost(
        no_sync=contextlib.nullcontext,
        fetch=lambda layout: iter([torch.zeros(1)] * len(layout.micro)),
        gradients_done=lambda: None,
        run_backward=lambda loss, weight, padding, scaler: None,
        broken=lambda: bool(dropped),
        peer_lost=lost,
    )
    return Step(host, step_layout(ElasticSampler(8), 4, 1), 1, 0, 1), seen


def _rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # the peer lost before the body's all-reduce
    step, seen = _step(is_peer_failure)
    with step:
        for _ in step:
            pass
        metric = torch.ones(1)
        dist.all_reduce(metric)  # the script's own collective: the peer is gone
        Path(out, "after").write_text("the rest of the body ran")
    Path(out, "rank0").write_text(f"dropped={step.dropped} seen={seen}")
    compat.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_peer_lost_in_the_scripts_own_collective_under_with_step_drops_the_step(tmp_path: Path) -> None:
    with contextlib.suppress(Exception):  # rank 1 leaves with os._exit(0) on purpose
        start_ranks(_rank, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank0").read_text() == "dropped=True seen=['RuntimeError']"
    assert not (tmp_path / "after").exists(), "the rest of the body is skipped"


@pytest.mark.timeout(30)
def test_other_errors_in_the_body_and_any_error_in_restart_mode_are_raised() -> None:
    step, _ = _step(is_peer_failure)
    with pytest.raises(ValueError, match="the script's own"), step:
        raise ValueError("the script's own bug")
    restart, seen = _step(lambda exc: False)  # restart mode: no error is a lost peer
    with pytest.raises(RuntimeError, match="gloo: connection closed"), restart:
        raise RuntimeError("gloo: connection closed")
    assert seen == ["RuntimeError"] and not restart.dropped
