"""The trainer's parallel strategies (elastic/train/strategy*.py): which one a model and a config get, what is
refused before any process group forms, and restart mode's recovery (a step recorded once applied, nothing dropped,
nothing re-formed). The strategies' training is checked through the trainer: tests/elastic/train and the integration
suites (restart, live, FSDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic.contract.lr import LRPolicy, LRRule
from elastic.live.protocol import ReformReason
from elastic.train.config import ElasticConfig, RecoveryMode, StepInfo
from elastic.train.strategy import LoopParts, RestartRecovery, StrategyError
from elastic.train.strategy_ddp import DDPStrategy
from elastic.train.strategy_factory import create_strategy
from elastic.train.strategy_live import LiveGroupRecovery, LiveReplicatedStrategy
from elastic.train.strategy_sharded import ShardedStrategy

pytestmark = pytest.mark.timeout(60)


def _config(recovery: RecoveryMode, shard_size: int | None = None) -> ElasticConfig:
    return ElasticConfig(LRPolicy(LRRule.FIXED_GLOBAL_BATCH, 0.1, 2, 4), None, recovery=recovery, shard_size=shard_size)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _parallelize(module: nn.Module, mesh: Any) -> nn.Module:
    return module  # never called: choosing a strategy shards nothing


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_plain_model_trains_with_ddp_in_restart_mode_and_with_the_live_all_reduce_in_live_mode() -> None:
    model = _model()
    restart = create_strategy(model, None, [_sgd(model)], _config(RecoveryMode.RESTART))
    assert isinstance(restart, DDPStrategy) and isinstance(restart.recovery, RestartRecovery)
    assert (restart.sharded, restart.shards, restart.storage_required, restart.granularity) == (False, None, True, 1)
    assert restart.module is model and restart.generation is None and restart.mesh is None
    live = create_strategy(model, None, [_sgd(model)], _config(RecoveryMode.LIVE))
    assert isinstance(live, LiveReplicatedStrategy) and isinstance(live.recovery, LiveGroupRecovery)
    assert (live.sharded, live.storage_required, live.granularity) == (False, False, 1)


@pytest.mark.parametrize("recovery", [RecoveryMode.RESTART, RecoveryMode.LIVE])
def test_with_parallelize_the_sharded_strategy_joins_in_whole_replicas_of_a_node_unless_configured(
    recovery: RecoveryMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = _model()
    node = create_strategy(model, _parallelize, [_sgd(model)], _config(recovery))
    assert isinstance(node, ShardedStrategy) and node.sharded and node.granularity == 4
    assert isinstance(node.recovery, LiveGroupRecovery if recovery is RecoveryMode.LIVE else RestartRecovery)
    assert node.storage_required is (recovery is RecoveryMode.RESTART)
    assert node.shards is None and node.shard_size is None  # the sharded model is made once the group formed
    configured = create_strategy(model, _parallelize, [_sgd(model)], _config(recovery, shard_size=2))
    assert configured.granularity == 2


def test_a_sharded_model_with_two_optimizers_is_refused_before_any_process_group_forms() -> None:
    model = _model()
    with pytest.raises(StrategyError, match="a sharded model takes one optimizer"):
        create_strategy(model, _parallelize, [_sgd(model), _sgd(model)], _config(RecoveryMode.RESTART))
    assert issubclass(StrategyError, ValueError)


def test_a_bad_replica_size_is_refused_by_the_factory() -> None:
    model = _model()
    with pytest.raises(ValueError, match="shard_size"):
        create_strategy(model, _parallelize, [_sgd(model)], _config(RecoveryMode.RESTART, shard_size=0))


def test_restart_mode_records_a_step_once_applied_and_never_drops_or_re_forms(gloo_world_1: None) -> None:
    recorded: list[StepInfo] = []
    recovery = RestartRecovery()
    restored: list[tuple[int, int]] = []
    parts = LoopParts(torch.device("cpu"), None, None, None, None, None, recorded.append)  # type: ignore[arg-type]
    recovery.start(parts, _model(), lambda rank, world: restored.append((rank, world)) is None)
    assert restored == [(0, 1)]
    recovery.begin_step(StepInfo(1, 0, 0, 1, [0, 1], 0.0, None), global_batch=2)
    assert recorded == []
    recovery.step_applied(0.5, 1.25)
    assert recorded == [StepInfo(1, 0, 0, 1, [0, 1], 0.5, 1.25)]
    recovery.step_committed()
    assert recorded == [StepInfo(1, 0, 0, 1, [0, 1], 0.5, 1.25)]
    assert not recovery.peer_failed(RuntimeError("Connection closed by peer")) and not recovery.dropped
    assert not recovery.joiners_waiting(0) and recovery.generation is None
    assert recovery.reform(ReformReason.FAILURE) is False


def test_the_live_modules_are_imported_only_for_live_recovery(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from elastic.train.trainer import ElasticTrainer\n"
        "from elastic.train.strategy_factory import create_strategy\n"
        "print('elastic.train.live' in sys.modules, 'elastic.train.strategy_live' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
