"""Node-local snapshots of a sharded model (elastic.train.shard_tier), in four real gloo processes sharing one
"node" directory: every rank writes its shard; new trainers' models (a restart) take the newest local step that
every shard index has (not a newer one only some shards reached), bit for bit, also into a smaller world; a
corrupt shard file, a missing shard index or an older local step than the durable one sends the caller to the
durable snapshot."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic.checkpoint.state import capture_training_state
from elastic.testing.train_worker import parallelize as _parallelize
from elastic.train.parallel import ShardedModel
from elastic.train.shard_tier import ShardTier
from tests.ranks import start_ranks

pytestmark = pytest.mark.timeout(180)


def _fresh(seed: int) -> tuple[ShardedModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return ShardedModel(model, _parallelize, optimizer, 2, torch.device("cpu")), optimizer


def _digest(sharded: ShardedModel, optimizer: torch.optim.Optimizer) -> str:
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    tensors = [*sharded.module.parameters(), *(v for st in optimizer.state.values() for v in st.values())]
    for t in tensors:
        h.update((t.to_local() if isinstance(t, DTensor) else t).detach().numpy().tobytes())
    return h.hexdigest()[:16]


def _train(sharded: ShardedModel, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        F.cross_entropy(sharded.module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _loop(step: int) -> dict[str, Any]:
    return capture_training_state(
        step, nn.Module(), None, None, gather_rng=False, data_cursor={"position": step}
    ).to_dict()


def _restart(tier_dir: Path, rank: int, world: int) -> tuple[ShardTier, ShardedModel, torch.optim.Optimizer]:
    sharded, optimizer = _fresh(seed=99)  # other initial values: everything must come from the tier
    sharded.build(rank, world)
    return ShardTier(sharded, tier_dir, 1, torch.device("cpu")), sharded, optimizer


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank % 2), "2"  # two "nodes" of two workers
    tier_dir = Path(tmp) / "tier"
    out: dict[str, Any] = {}
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/s1", 4), rank=rank, world_size=4)
    sharded, optimizer = _fresh(seed=0)
    sharded.build(rank, 4)
    tier = ShardTier(sharded, tier_dir, 1, torch.device("cpu"))
    _train(sharded, optimizer, 3)
    assert tier.want_local(3)
    tier.save_local(3, lambda: _loop(3))
    out["saved"] = _digest(sharded, optimizer)
    _train(sharded, optimizer, 2)  # the live state moves on after the snapshot
    if rank % 2 == 1:  # step 4 reaches shard 1's slots only (a failure cut shard 0's writes short)
        assert tier.want_local(4)
        tier.save_local(4, lambda: _loop(4))
    tier.close()  # flushed (and the slot released, as at a worker's exit)

    # a restart at the same world: step 3 is the newest that every shard index has (step 4 only shard 1), newer
    # than the durable snapshot (step 1)
    tier, sharded, optimizer = _restart(tier_dir, rank, 4)
    ts = tier.restore(durable_step=1)
    out["step"], out["cursor"] = (ts.step, dict(ts.data_cursor)) if ts is not None else (None, None)
    out["restored"] = _digest(sharded, optimizer)
    out["older_than_durable"] = tier.restore(durable_step=3) is None
    tier.close()
    dist.destroy_process_group()

    # a smaller world (one replica): still every shard index
    if rank < 2:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/s2", 2), rank=rank, world_size=2)
        tier, sharded, optimizer = _restart(tier_dir, rank, 2)
        out["smaller"] = tier.restore(durable_step=-1) is not None and _digest(sharded, optimizer) == out["saved"]
        tier.close()
        dist.barrier()
        if rank == 0:  # a flipped byte in every replica-0 copy of shard 0: the load fails there
            for f in sorted((tier_dir / "n2-i0-0").rglob("*")):
                if f.is_file() and f.stat().st_size > 1000:
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    f.write_bytes(bytes(data))
        dist.barrier()
        tier, sharded, optimizer = _restart(tier_dir, rank, 2)
        out["corrupt"] = tier.restore(durable_step=-1) is None
        tier.close()
        dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))


def test_shard_snapshots_restore_bit_for_bit_when_every_shard_is_there_else_the_durable_one_is_used(
    tmp_path: Path,
) -> None:
    start_ranks(_worker, (str(tmp_path),), 4)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(4)]
    assert sorted(p.name for p in (tmp_path / "tier").iterdir() if p.is_dir()) == [
        "n2-i0-0",
        "n2-i0-1",
        "n2-i1-0",
        "n2-i1-1",
    ], "one slot per rank, named after its shard"
    for i in range(4):
        assert r[i]["step"] == 3 and r[i]["cursor"] == {"position": 3}
        assert r[i]["restored"] == r[i]["saved"], f"rank {i}: the restored shard is not the saved one"
        assert r[i]["older_than_durable"], "a local step no newer than the durable one is not used"
    assert r[0]["saved"] == r[2]["saved"] and r[0]["saved"] != r[1]["saved"]
    assert r[0]["smaller"] and r[1]["smaller"], "one replica of a 2 x 2 world restores from the same snapshots"
    assert r[0]["corrupt"] and r[1]["corrupt"], "a corrupt shard file must send every rank to the durable snapshot"
