"""Which :class:`~elastic.train.strategy.ParallelStrategy` a model trains with: chosen once, from the config's
recovery mode and the model, before any process group forms.

============================================  ============  ==================================================
the model                                     recovery      strategy
============================================  ============  ==================================================
plain, or wrapped in DDP by the script        restart       :class:`~elastic.train.strategy_ddp.DDPStrategy`
plain                                         live          :class:`~elastic.train.strategy_live.LiveReplicatedStrategy`
plain with ``parallelize=``                   either        :class:`~elastic.train.strategy_sharded.ShardedStrategy`
sharded by the script (``fully_shard``)       restart       :class:`~elastic.train.strategy_sharded.ShardedStrategy`
============================================  ============  ==================================================

Anything else (a script-sharded or DDP-wrapped model in live mode, ``parallelize=`` with a module sharded or
wrapped already, a sharded model with several optimizers) is refused with a ``ValueError`` naming what to pass.
The live modules are imported only when live recovery is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from elastic import compat
from elastic.train.config import ElasticConfig, RecoveryMode
from elastic.train.parallel import Parallelize, check_model
from elastic.train.strategy import ParallelStrategy, Recovery, RestartRecovery, StrategyError
from elastic.train.strategy_ddp import DDPStrategy
from elastic.train.strategy_sharded import ShardedStrategy

__all__ = ["create_strategy"]


def create_strategy(
    model: nn.Module,
    parallelize: Parallelize | None,
    optimizers: Sequence[torch.optim.Optimizer],
    config: ElasticConfig,
) -> ParallelStrategy:
    """The strategy for ``model`` (see the module docstring); no process group, no collective. Raises ValueError
    (:class:`~elastic.train.strategy.StrategyError` for several optimizers of a sharded model) for a combination no
    strategy trains."""
    live = config.resolved_recovery() is RecoveryMode.LIVE
    check_model(model, parallelize, live=live)
    if parallelize is not None or compat.is_sharded_module(model):
        if len(optimizers) > 1:
            raise StrategyError("a sharded model takes one optimizer (its state is saved in the sharded layout)")
        recovery: Recovery
        if live:
            from elastic.train.strategy_live import LiveGroupRecovery

            recovery = LiveGroupRecovery(config)
        else:
            recovery = RestartRecovery()
        return ShardedStrategy(model, parallelize, optimizers[0], config, recovery)
    if live:
        from elastic.train.strategy_live import LiveReplicatedStrategy

        return LiveReplicatedStrategy(model, config)
    return DDPStrategy(model, config)
