"""Sharded models, FSDP2 and HSDP, in restart or live mode (see :mod:`elastic.train.strategy` for the interface).

Two ways in:

- ``parallelize=fn(module, mesh)`` with the unsharded module: the trainer shards it for each world
  (:class:`~elastic.train.parallel.ShardedModel`: at each start in restart mode, at each generation in live mode,
  where the surviving replicas keep their shards in place), on a (replicate, shard) mesh of replicas of
  :attr:`~ShardedStrategy.shard_size` ranks (a node's workers unless configured); workers join a live group in whole
  replicas;
- a module the script sharded itself with ``fully_shard`` (restart mode only: a live generation could not reshard
  it; the factory refuses it).

Either way the model is not wrapped in DDP (DDP would broadcast the shards as whole tensors): FSDP reduce-scatters the
gradients during the last micro-batch's backward (``no_sync``: :func:`~elastic.train.sharded.gradient_sync_off`), and
the snapshots use the sharded layout (:func:`~elastic.train.sharded.capture_sharded`). In live mode the model the
script calls is a :class:`~elastic.train.parallel.GuardedForward`: a lost peer in the forward pass's all-gathers
drops the step as one in a backward does. The recovery (restart or live) is the factory's choice.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from elastic.contract.env import TorchrunEnv
from elastic.train.config import ElasticConfig
from elastic.train.parallel import GuardedForward, Parallelize, ShardedModel, ShardLayout
from elastic.train.sharded import capture_sharded, gradient_sync_off
from elastic.train.strategy import LoopParts, ParallelStrategy, Recovery

logger = logging.getLogger(__name__)

__all__ = ["ShardedStrategy"]


class ShardedStrategy(ParallelStrategy):
    """See the module docstring. ``model``: the unsharded module with ``parallelize``, else the module the script
    sharded; ``optimizer``: the one optimizer, made over ``model``'s parameters (the trainer re-points it at each
    world's shards)."""

    sharded = True

    def __init__(
        self,
        model: nn.Module,
        parallelize: Parallelize | None,
        optimizer: torch.optim.Optimizer,
        config: ElasticConfig,
        recovery: Recovery,
    ) -> None:
        super().__init__(config, recovery)
        self._given = model
        self._parallelize, self._optimizer = parallelize, optimizer
        self._replica = 1
        if parallelize is not None:
            self._replica = ShardLayout.replica_size(config.shard_size, TorchrunEnv.from_environ().local_world_size)
        self._parallel: ShardedModel | None = None  # made once the device is known (join)

    @property
    def granularity(self) -> int:
        return self._replica

    def join(self) -> torch.device:
        device = super().join()
        if self._parallelize is not None:
            self._parallel = ShardedModel(self._given, self._parallelize, self._optimizer, self._replica, device)
        return device

    @property
    def shards(self) -> ShardedModel | None:
        return self._parallel

    def start(self, parts: LoopParts) -> nn.Module:
        """Shard the model for this world (``parallelize``) and restore or receive its state; a model the script
        sharded stays where ``fully_shard`` placed its shards."""
        self._parts = parts
        self.recovery.start(parts, self._parallel or self._given, self._restore)
        return self.wrap()

    @property
    def module(self) -> nn.Module:
        return self._parallel.module if self._parallel is not None else self._given

    @property
    def mesh(self) -> Any:
        return self._parallel.mesh if self._parallel is not None else None

    @property
    def shard_size(self) -> int | None:
        return self._parallel.shard_size if self._parallel is not None else None

    def wrap(self) -> nn.Module:
        """The sharded module itself; in live mode behind a :class:`GuardedForward` (its forward's all-gathers)."""
        if self.recovery.live and self._parallel is not None:
            return GuardedForward(self.module, self._parallel, self.peer_failed)
        return self.module

    def no_sync(self) -> AbstractContextManager[Any]:
        return gradient_sync_off(self.module)

    def capture(self, step: int) -> dict[str, Any]:
        """The sharded layout's mapping (a collective: gathers every rank's RNG state)."""
        p = self.parts
        return capture_sharded(step, self.module, p.optimizer, p.scheduler, **p.cursor.state())
