"""FSDP2 models in the elastic loop, in one process (a gloo world of one): the refusal of live recovery, the
sharded snapshot's loop entry, and a save-then-resume through two trainers. The multi-worker cases (resharding
into other world sizes, a corrupt shard, kills) run under torchrun in tests/integration/test_elastic_fsdp.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import TensorDataset

from elastic import compat
from elastic.checkpoint import CheckpointOptions, StateLayout, create_checkpoint_manager
from elastic.contract.lr import LRPolicy, LRRule
from elastic.train.sharded import capture_sharded, loop_state
from elastic.train.snapshots import LoopCheckpoints
from elastic.train.trainer import ElasticConfig, ElasticTrainer, RecoveryMode
from tests.elastic.train._deferral_worker import SlowStorage

pytestmark = pytest.mark.timeout(120)


def _sharded_mlp(seed: int = 0) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _plain_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    assert mesh.mesh_dim_names == ("replicate", "shard")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 8, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long() + (x[:, 0] > 1).long())


def _config(url: Path, recovery: RecoveryMode | None = None) -> ElasticConfig:
    # fixed-global-batch 2 x 4 on one worker: two micro-batches per step (gradient sync off for the first)
    policy = LRPolicy(LRRule.FIXED_GLOBAL_BATCH, 0.1, 2, 4)
    return ElasticConfig(policy, str(url), save_every_steps=3, progress_every=0, recovery=recovery)


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def test_a_model_sharded_already_is_refused_by_live_recovery_at_construction_naming_parallelize(
    gloo_world_1: None, tmp_path: Path
) -> None:
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"pass the unsharded module and parallelize="):
        ElasticTrainer(model, optimizer, _data(), _config(tmp_path, RecoveryMode.LIVE))


def test_parallelize_with_a_module_sharded_already_is_refused(gloo_world_1: None, tmp_path: Path) -> None:
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"with parallelize=, pass the unsharded"):
        ElasticTrainer(model, optimizer, _data(), _config(tmp_path), parallelize=_parallelize)


def test_the_loop_entry_of_a_sharded_snapshot_holds_step_cursor_and_rng(gloo_world_1: None) -> None:
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cursor = {
        "data_cursor": {"sampler": {"epoch": 2, "position": 8}},
        "world_size": 1,
        "lr_reference": {},
        "extras": {"lr_ramp": {"start_step": 0, "start_factor": 1.0, "target_factor": 1.0}},
    }
    state = capture_sharded(17, model, optimizer, None, **cursor)
    assert set(state) == {"model", "optim", "loop"} and isinstance(state["loop"], bytes)
    loop = loop_state(state)
    assert loop.step == 17 and dict(loop.data_cursor) == cursor["data_cursor"] and list(loop.rng) == [0]
    assert torch.equal(loop.rng[0]["torch"], torch.get_rng_state())


def test_a_trainer_saves_sharded_snapshots_and_the_next_one_resumes_the_full_state(
    gloo_world_1: None, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ElasticTrainer(model, optimizer, _data(), _config(ck))
    assert trainer.model is model, "no DDP wrap"
    for x, y in trainer.batches(epochs=2):
        if trainer.step >= 6:
            break
        trainer.backward(F.cross_entropy(trainer.model(x), y))
    saved_model, saved_optim = _full(model, optimizer)
    trainer.close()
    reader = create_checkpoint_manager(str(ck), CheckpointOptions(layout=StateLayout.SHARDED))
    assert [s.step for s in reader.list_snapshots()][-1] == 6
    assert all(s.manifest.kind.value == "dcp" for s in reader.list_snapshots())

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model2 = _sharded_mlp(seed=99)  # other initial values: all of them must come from the snapshot
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    trainer2 = ElasticTrainer(model2, optimizer2, _data(), _config(ck))
    assert trainer2.step == 6 and trainer2.resumed_from == "durable"
    got_model, got_optim = _full(model2, optimizer2)
    assert got_model.keys() == saved_model.keys()
    for k, v in saved_model.items():
        assert torch.equal(got_model[k], v), k
    assert got_optim["state"].keys() == saved_optim["state"].keys()
    for k, per_param in saved_optim["state"].items():
        assert torch.equal(got_optim["state"][k]["momentum_buffer"], per_param["momentum_buffer"]), k
    trainer2.close()


def test_with_parallelize_the_trainer_shards_the_model_trains_it_like_the_script_sharded_one_and_resumes_it(
    gloo_world_1: None, tmp_path: Path
) -> None:
    """Restart mode: ``parallelize=`` gives the same training as a model the script sharded itself (bit for bit),
    the optimizer made over the unsharded module follows the shards, and the snapshot resumes the full state."""
    ck, ck_ref = tmp_path / "ck", tmp_path / "ref"
    reference = _sharded_mlp()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref = ElasticTrainer(reference, ref_optimizer, _data(), _config(ck_ref))
    for x, y in ref.batches(epochs=2):
        if ref.step >= 6:
            break
        ref.backward(F.cross_entropy(ref.model(x), y))
    want_model, want_optim = _full(reference, ref_optimizer)
    ref.close()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = _plain_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ElasticTrainer(model, optimizer, _data(), _config(ck), parallelize=_parallelize)
    assert compat.is_sharded_module(trainer.module) and trainer.shard_size == 1
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in trainer.module.parameters()]
    for x, y in trainer.batches(epochs=2):
        if trainer.step >= 6:
            break
        trainer.backward(F.cross_entropy(trainer.model(x), y))
    got_model, got_optim = _full(trainer.module, optimizer)
    for k, v in want_model.items():
        assert torch.equal(got_model[k], v), k
    for k, per_param in want_optim["state"].items():
        assert torch.equal(got_optim["state"][k]["momentum_buffer"], per_param["momentum_buffer"]), k
    trainer.close()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model2 = _plain_mlp(seed=99)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    trainer2 = ElasticTrainer(model2, optimizer2, _data(), _config(ck), parallelize=_parallelize)
    assert trainer2.step == 6 and trainer2.resumed_from == "durable"
    resumed_model, _ = _full(trainer2.module, optimizer2)
    for k, v in want_model.items():
        assert torch.equal(resumed_model[k], v), k
    trainer2.close()


class _FailingCommit(SlowStorage):
    """:class:`SlowStorage` whose commit, once its delay is over, fails."""

    def publish(self, rel: str, data: bytes) -> None:
        if rel.startswith(".probe"):
            return super().publish(rel, data)
        time.sleep(self.delay)
        raise OSError("the storage refused the manifest")


def _in_flight_sharded_save(tmp_path: Path, storage: SlowStorage) -> tuple[LoopCheckpoints, float]:
    """A sharded model's loop checkpoints with the background save of step 5 in flight; when it started."""
    model = _sharded_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = LoopCheckpoints(_config(tmp_path / "ck"), storage, torch.device("cpu"), sharded=True)
    cursor = {"data_cursor": {}, "world_size": 1, "lr_reference": {}, "extras": {}}
    started = time.monotonic()
    checkpoints.save(5, lambda: capture_sharded(5, model, optimizer, None, **cursor), optimizer, blocking=False)
    assert checkpoints.manager is not None and checkpoints.manager.in_flight
    return checkpoints, started


def _reform() -> None:
    """What a live re-form does to the process group: replaced (every group, the sharded saver's too)."""
    compat.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_live_admission_waits_for_the_sharded_save_in_flight_which_commits_before_the_group_is_replaced(
    gloo_world_1: None, tmp_path: Path
) -> None:
    checkpoints, started = _in_flight_sharded_save(tmp_path, SlowStorage(tmp_path / "ck", 1.0))
    checkpoints.before_reform(admit=True)
    manager = checkpoints.manager
    assert manager is not None and not manager.in_flight and time.monotonic() - started >= 1.0
    assert manager.last_committed_step == 5
    _reform()
    checkpoints.close(finished=True)  # nothing pending: no error
    with create_checkpoint_manager(str(tmp_path / "ck"), CheckpointOptions(layout=StateLayout.SHARDED)) as reader:
        assert [s.step for s in reader.list_snapshots()] == [5]


def test_after_a_live_failure_the_sharded_save_in_flight_is_given_up_its_error_logged_and_never_raised(
    gloo_world_1: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints, _ = _in_flight_sharded_save(tmp_path, _FailingCommit(tmp_path / "ck", 0.5))
    checkpoints.before_reform(admit=False)  # returns at once: the failed member's part will never come
    manager = checkpoints.manager
    assert manager is not None and not manager.in_flight
    _reform()
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.sharded"):
        checkpoints.close(finished=True)  # waits for nothing, raises nothing
        deadline = time.monotonic() + 30
        while "given up at a re-form, did not commit" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "sharded checkpoint step 5" in caplog.text and "did not commit" in caplog.text
    with create_checkpoint_manager(str(tmp_path / "ck"), CheckpointOptions(layout=StateLayout.SHARDED)) as reader:
        assert reader.list_snapshots() == []
