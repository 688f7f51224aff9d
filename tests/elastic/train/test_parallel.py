"""The model the trainer shards for each world (elastic.train.parallel): the pure decisions, the structure kept on the
meta device, the forward guard, and, in four real gloo processes, a live HSDP life cycle: 2 replicas x 2 shards
train, one replica leaves (the survivors keep their shards in place), two fresh processes join and receive each
shard from the surviving replica, and training goes on with replicas identical bit for bit."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic.live.state_sync import broadcast_state
from elastic.testing.train_worker import parallelize as _parallelize
from elastic.train.parallel import (
    GuardedForward,
    ShardedModel,
    ShardLayout,
    ShardSources,
    meta_copy,
    shard_sources,
    share_shards,
)
from tests.ranks import start_ranks

pytestmark = pytest.mark.timeout(60)


# -- pure decisions ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("steps", "kept", "expected"),
    [
        pytest.param([5, 5, 5, 5], [True] * 4, ShardSources((0, 1), (False, False)), id="all-kept-no-broadcast"),
        pytest.param(
            [5, 5, -1, -1],
            [True, True, False, False],
            ShardSources((0, 1), (True, True)),
            id="joiners-take-the-survivors-shards",
        ),
        pytest.param(
            [-1, -1, 5, 5],
            [False, False, True, True],
            ShardSources((2, 3), (True, True)),
            id="the-holder-need-not-be-rank-0",
        ),
        pytest.param(
            [5, 4, 5, 5], [True] * 4, ShardSources((0, 3), (False, True)), id="a-member-a-step-behind-receives"
        ),
        pytest.param([5, 5], [True, True], ShardSources((0, 1), (False, False)), id="one-replica"),
        pytest.param([5, 5, -1, -1], [True, False, False, False], None, id="shard-1-lost-no-full-replica"),
        pytest.param([5, 4, -1, -1], [True, True, False, False], None, id="shard-1-only-behind"),
    ],
)
def test_shard_sources_picks_per_shard_index_the_first_member_that_kept_it_at_the_step_or_none(
    steps: list[int], kept: list[bool], expected: ShardSources | None
) -> None:
    assert shard_sources(steps, kept, 5, 2) == expected


def test_shard_sources_refuses_mismatched_claims_and_a_world_of_partial_replicas() -> None:
    with pytest.raises(ValueError):
        shard_sources([1, 1, 1], [True, True, True], 1, 2)
    with pytest.raises(ValueError):
        shard_sources([1, 1], [True], 1, 2)


def test_a_shard_layout_needs_whole_replicas_and_the_same_shard_means_same_size_and_index() -> None:
    assert ShardLayout.of(5, 8, 4) == ShardLayout(4, 1, 2)
    with pytest.raises(ValueError, match="does not divide"):
        ShardLayout.of(0, 6, 4)
    assert ShardLayout(2, 1, 1).same_shard(ShardLayout(2, 1, 3))
    assert not ShardLayout(2, 1, 1).same_shard(ShardLayout(2, 0, 1))
    assert not ShardLayout(2, 1, 2).same_shard(ShardLayout(4, 1, 1))
    assert not ShardLayout(2, 1, 2).same_shard(None)
    assert ShardLayout.replica_size(None, 8) == 8 and ShardLayout.replica_size(2, 8) == 2
    with pytest.raises(ValueError, match="shard_size"):
        ShardLayout.replica_size(0, 8)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Dropout(0.1), nn.Linear(33, 4))
    model.register_buffer("scale", torch.full((4,), 0.5), persistent=False)  # lost by to_empty unless moved
    return model


def test_meta_copy_keeps_the_structure_without_memory_and_leaves_the_model_alone() -> None:
    model = _model()
    model[0].bias.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    template = meta_copy(model)
    assert [n for n, _ in template.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.is_meta for p in template.parameters()) and all(b.is_meta for b in template.buffers())
    assert not template[0].bias.requires_grad and template[0].weight.requires_grad
    assert all(not p.is_meta for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_forward_guard_turns_a_lost_peer_into_a_placeholder_shaped_like_the_output_and_raises_the_rest() -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.error: RuntimeError | None = None

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            if self.error is not None:
                raise self.error
            return {"logits": self.net(x), "n": 3}

    flaky = Flaky()
    optimizer = torch.optim.SGD(flaky.parameters(), lr=0.1)
    sharded = ShardedModel(flaky, lambda m, _mesh: m, optimizer, 1, torch.device("cpu"))
    failures: list[RuntimeError] = []

    def on_failure(exc: RuntimeError) -> bool:
        failures.append(exc)
        return "closed by peer" in str(exc)

    guarded = GuardedForward(flaky, sharded, on_failure)
    x = torch.randn(5, 16)
    assert guarded(x)["logits"].shape == (5, 4)
    flaky.error = RuntimeError("[gloo/pair.cc] Connection closed by peer")
    out = guarded(x)
    assert out["n"] == 3 and out["logits"].shape == (5, 4) and out["logits"].requires_grad
    assert torch.count_nonzero(out["logits"]) == 0 and out["logits"].device == x.device
    F.cross_entropy(out["logits"], torch.zeros(5, dtype=torch.long))  # the script's loss still computes
    flaky.error = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes"):
        guarded(x)
    assert len(failures) == 2


# -- four processes: a live HSDP life cycle ----------------------------------------------------------------
def _digest(sharded: ShardedModel, optimizer: torch.optim.Optimizer) -> str:
    """This rank's shards and optimizer state, and the non-persistent buffer."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    h = hashlib.sha256()
    for p in sharded.module.parameters():
        h.update(local(p).detach().numpy().tobytes())
    for state in optimizer.state.values():
        for v in state.values():
            h.update(local(v).detach().numpy().tobytes())
    h.update(sharded.module.get_buffer("scale").numpy().tobytes())
    return h.hexdigest()[:16]


def _train(sharded: ShardedModel, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * seed + i)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        F.cross_entropy(sharded.module(x) * sharded.module.get_buffer("scale"), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _share(sharded: ShardedModel, rank: int, world: int, step: int, kept: bool) -> ShardSources:
    claims: list[Any] = [None] * world
    dist.all_gather_object(claims, (step if kept or rank < 2 else -1, kept))
    plan = shard_sources([c[0] for c in claims], [c[1] for c in claims], step, sharded.shard_size)
    assert plan is not None
    source = plan.sources[rank % sharded.shard_size]
    if plan.needed[rank % sharded.shard_size]:
        payload = sharded.local_payload() if rank == source else None
        got = broadcast_state(payload, source, torch.device("cpu"), group=sharded.replicate_group())
        if rank != source:
            sharded.apply_payload(got)
    return plan


def _fresh() -> tuple[ShardedModel, torch.optim.Optimizer]:
    model = _model(seed=1)  # a joiner's own initial values: everything must come from its replicate group
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return ShardedModel(model, _parallelize, optimizer, 2, torch.device("cpu")), optimizer


def _life_cycle(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    sharded, optimizer = _fresh()
    # generation 1: 2 replicas x 2 shards, founded (no state to keep)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/s1", 4), rank=rank, world_size=4)
    out["kept1"] = sharded.build(rank, 4)
    _train(sharded, optimizer, 3, seed=rank % 2)  # both replicas see the same data: they stay identical
    out["d1"] = _digest(sharded, optimizer)
    dist.destroy_process_group()
    # generation 2: ranks 2 and 3 (a replica) are gone; 0 and 1 go on alone
    if rank < 2:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/s2", 2), rank=rank, world_size=2)
        out["kept2"] = sharded.build(rank, 2)
        out["d2"] = _digest(sharded, optimizer)
        _train(sharded, optimizer, 2, seed=10 + rank)
        out["d2b"] = _digest(sharded, optimizer)
        dist.destroy_process_group()
    else:
        sharded, optimizer = _fresh()  # a new process of the replacement node
    # generation 3: the replacement replica joins
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/s3", 4), rank=rank, world_size=4)
    out["kept3"] = sharded.build(rank, 4)
    out["plan3"] = _share(sharded, rank, 4, step=5, kept=out["kept3"])
    out["d3"] = _digest(sharded, optimizer)
    out["lr3"] = optimizer.param_groups[0]["lr"]
    _train(sharded, optimizer, 2, seed=20 + rank % 2)
    out["d3b"] = _digest(sharded, optimizer)
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))


@pytest.mark.timeout(180)
def test_a_replica_leaves_and_a_new_one_joins_survivors_keep_their_shards_joiners_receive_them(tmp_path: Path) -> None:
    started = time.monotonic()
    start_ranks(_life_cycle, (str(tmp_path),), 4)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(4)]
    assert [x["kept1"] for x in r] == [False] * 4
    assert r[0]["d1"] == r[2]["d1"] and r[1]["d1"] == r[3]["d1"] and r[0]["d1"] != r[1]["d1"]
    # the survivors' shards (and the AdamW moments, and the non-persistent buffer) are kept in place
    assert r[0]["kept2"] and r[1]["kept2"]
    assert r[0]["d2"] == r[0]["d1"] and r[1]["d2"] == r[1]["d1"]
    assert r[0]["d2b"] != r[0]["d2"], "the survivors trained on"
    # the joiners take each shard from the survivor of its index; the survivors keep theirs
    assert [x["kept3"] for x in r] == [True, True, False, False]
    assert r[0]["plan3"] == ShardSources((0, 1), (True, True))
    assert r[2]["d3"] == r[0]["d2b"] and r[3]["d3"] == r[1]["d2b"]
    assert r[0]["d3"] == r[0]["d2b"] and r[1]["d3"] == r[1]["d2b"]
    assert all(x["lr3"] == 0.01 for x in r)
    # and the replicas stay identical while training on together
    assert r[0]["d3b"] == r[2]["d3b"] and r[1]["d3b"] == r[3]["d3b"] and r[0]["d3b"] != r[0]["d3"]
    assert time.monotonic() - started < 170


# -- CUDA (scripts/gpu_check.sh): the same re-form in place on a GPU, at the world size one GPU allows ----------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(180)
def test_on_cuda_a_re_formed_nccl_group_keeps_the_shards_in_place_and_shares_them_over_its_replicate_group() -> None:
    """World size 1 under NCCL: shard on the GPU, train, tear the group down and form a new one (a live re-form),
    build again (the shards and AdamW state kept on the device), send the shard over the 1-rank replicate group
    (NCCL broadcasts from the GPU), and the guard's placeholder lands on the GPU."""
    assert not dist.is_initialized(), "another test left a process group behind"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
        model.register_buffer("scale", torch.full((4,), 0.5), persistent=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        sharded = ShardedModel(model.to(device), _parallelize, optimizer, 1, device)
        assert sharded.build(0, 1) is False
        x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
        for _ in range(3):
            F.cross_entropy(sharded.module(x) * sharded.module.get_buffer("scale"), y).backward()
            optimizer.step()
            optimizer.zero_grad()

        def state() -> list[torch.Tensor]:
            from torch.distributed.tensor import DTensor

            tensors = [*sharded.module.parameters(), *(v for st in optimizer.state.values() for v in st.values())]
            return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]

        before = state()
        dist.destroy_process_group()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        assert sharded.build(0, 1) is True
        assert all(p.device == device for p in sharded.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(state(), before, strict=True)), "the shards moved"
        loop = share_shards(sharded, ShardSources((0,), (True,)), 0, device, {"step": 3}, needed_only=False)
        assert loop == {"step": 3}
        out = GuardedForward(sharded.module, sharded, lambda exc: True).forward(x)
        assert out.device == device
        placeholder = sharded.placeholder((x,), {})
        assert placeholder.device == device and placeholder.shape == (8, 4)
        F.cross_entropy(sharded.module(x), y).backward()
        optimizer.step()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
