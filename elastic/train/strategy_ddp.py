"""Restart mode with replicated state: torch's ``DistributedDataParallel`` (see :mod:`elastic.train.strategy` for the
interface).

A plain module is moved to the rank's device, the newest snapshot is restored into it, and it is wrapped in DDP,
whose constructor broadcasts rank 0's parameters and buffers so that replicas start identical; DDP all-reduces the
gradients during the last micro-batch's backward (``no_sync`` on the others). A model the script wrapped in DDP
itself is trained as it is: the snapshot is restored into its module, then rank 0's state is broadcast as DDP's
constructor did before the restore. A failure stops every worker (:class:`~elastic.train.strategy.RestartRecovery`).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic.checkpoint.state import TrainingState
from elastic.live.grads import broadcast_module
from elastic.train.agreement import BoundaryAgreement, replicas_agreement
from elastic.train.collectives import HostCollectives
from elastic.train.config import ElasticConfig
from elastic.train.strategy import LoopParts, ParallelStrategy, RestartRecovery, capture_replicated

logger = logging.getLogger(__name__)

__all__ = ["DDPStrategy"]


class DDPStrategy(ParallelStrategy):
    """See the module docstring. ``model``: a plain module, or one the script wrapped in DDP."""

    def __init__(self, model: nn.Module, config: ElasticConfig) -> None:
        super().__init__(config, RestartRecovery())
        self._given = model if isinstance(model, DistributedDataParallel) else None
        self._module: nn.Module = model.module if isinstance(model, DistributedDataParallel) else model
        self._model: DistributedDataParallel | None = self._given

    def start(self, parts: LoopParts) -> nn.Module:
        self._parts = parts
        if self._given is not None:  # the script's DDP: restore into its module, then make replicas identical
            self.recovery.start(parts, self._module, self._restore)
            broadcast_module(self._module)
            return self._given
        self._module = self._module.to(parts.device)
        self.recovery.start(parts, self._module, self._restore)
        return self.wrap()  # DDP's constructor broadcasts rank 0's state

    @property
    def module(self) -> nn.Module:
        return self._module

    def wrap(self) -> nn.Module:
        device = self.parts.device
        device_ids = [device.index] if device.type == "cuda" else None
        self._model = DistributedDataParallel(self._module, device_ids=device_ids)
        return self._model

    def agreement(self, host: HostCollectives, world_size: int) -> BoundaryAgreement:
        """Overlapped with the next step (:class:`~elastic.train.agreement.DeferredAgreement`): DDP's gradient
        all-reduce already meets every rank once per step; a world of one has nothing to agree on. Every few steps
        (``agreement_interval``)."""
        return replicas_agreement(world_size, host.device, host.group, self.config.agreement_interval)

    def no_sync(self) -> AbstractContextManager[Any]:
        assert self._model is not None
        return self._model.no_sync()

    def capture(self, step: int) -> TrainingState:
        return capture_replicated(step, self._module, self.parts)
