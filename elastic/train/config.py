"""The settings of the elastic loop (:class:`ElasticConfig`) and what it tells a step hook (:class:`StepInfo`).

Both are re-exported by :mod:`elastic.train.trainer`, where :class:`~elastic.train.trainer.ElasticTrainer` uses them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from elastic.checkpoint.api import CheckpointOptions
from elastic.contract.env import WorkerEnv
from elastic.contract.lr import LRPolicy
from elastic.contract.recovery import RecoveryMode
from elastic.live.protocol import LiveOptions
from elastic.train.agreement import DEFAULT_INTERVAL
from elastic.train.schedule import SnapshotSchedule, WriterBusy, writer_busy

__all__ = ["ElasticConfig", "LiveOptions", "RecoveryMode", "StepInfo"]


@dataclass(frozen=True)
class ElasticConfig:
    """Settings of one job's elastic loop (``checkpoint_url`` defaults to ``$ETRAIN_CHECKPOINT_URL``, see
    :mod:`elastic.contract.env`)."""

    lr_policy: LRPolicy
    checkpoint_url: str | None = None
    checkpoint_options: CheckpointOptions = field(default_factory=CheckpointOptions)
    save_every_steps: int | None = 50
    # a durable snapshot at least this often in time as well (None: by steps only)
    save_every_seconds: timedelta | None = None
    # a snapshot due while the last one is still being written: "defer" it to when the writer is free, or
    # "wait" for the writer (the loop stalls); see elastic/train/schedule.py
    when_writer_busy: WriterBusy = WriterBusy.DEFER
    # node-local snapshots in memory (see elastic/checkpoint/tiers.py); None: $ETRAIN_LOCAL_SNAPSHOT_EVERY, else off
    local_every_steps: int | None = None
    # ... spaced out so that their measured cost stays under this fraction of training time (None: no cap)
    local_max_overhead: float | None = 0.05
    seed: int = 0
    shuffle: bool = True
    backend: str | None = None  # None: nccl with CUDA, else gloo
    progress_every: int = 10
    timeout: timedelta = timedelta(minutes=10)
    # after SIGTERM, how long to reach the step boundary before exiting without the final save (None: wait)
    stop_timeout: timedelta | None = timedelta(seconds=10)
    # DDP in restart mode: how long the ranks may go between agreements on the step boundary's flags (a time-based
    # snapshot, a SIGTERM), in steps of the group's slowest; zero: every step (see elastic/train/agreement.py)
    agreement_interval: timedelta = DEFAULT_INTERVAL
    total_steps: int | None = None  # only for progress reports to the job service
    # a failed save (storage away) is reported and the next one tried; saves failing for longer stop training
    save_failure_grace: timedelta = timedelta(minutes=5)
    # "restart" (torchrun's model) or "live" (see RecoveryMode and docs/live-recovery.md); None: "live" when the
    # worker's environment names a live group (torchrun's etcd-v3 handler with recovery=live), else "restart"
    recovery: RecoveryMode | None = None
    live: LiveOptions = field(default_factory=LiveOptions)
    # a model passed with parallelize=: the ranks of one replica (the mesh's "shard" dimension); None: one node's
    # workers (HSDP with a node as the replica); the world size for plain FSDP (see elastic/train/parallel.py)
    shard_size: int | None = None

    def __post_init__(self) -> None:
        if self.recovery is not None:
            try:
                object.__setattr__(self, "recovery", RecoveryMode(self.recovery))
            except ValueError:
                raise ValueError(f"recovery must be 'restart' or 'live', got {self.recovery!r}") from None
        object.__setattr__(self, "when_writer_busy", writer_busy(self.when_writer_busy))
        SnapshotSchedule(self.save_every_steps, self.save_every_seconds, self.when_writer_busy)  # validates them
        if self.agreement_interval < timedelta(0):
            raise ValueError(f"agreement_interval must be >= 0, got {self.agreement_interval}")
        if self.save_failure_grace < timedelta(0):
            raise ValueError(f"save_failure_grace must be >= 0, got {self.save_failure_grace}")
        if self.local_max_overhead is not None and not 0 < self.local_max_overhead < 1:
            raise ValueError(f"local_max_overhead must be in (0, 1) or None, got {self.local_max_overhead}")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1 or None, got {self.shard_size}")
        if self.local_every_steps is not None and self.local_every_steps < 1:
            raise ValueError(f"local_every_steps must be >= 1 or None, got {self.local_every_steps}")

    def resolved_recovery(self) -> RecoveryMode:
        """The recovery mode: the one given, else from the environment. Restart mode under a live rendezvous
        (each torchrun agent a world of its own node) would train every node alone: refused."""
        live_env = WorkerEnv.from_environ().live is not None
        if self.recovery is None:
            return RecoveryMode.LIVE if live_env else RecoveryMode.RESTART
        if self.recovery is RecoveryMode.RESTART and live_env:
            raise ValueError(
                "recovery='restart' under a live rendezvous (--rdzv-conf recovery=live): torchrun's "
                "worlds are node-local there; use recovery='live' or leave it unset"
            )
        return self.recovery

    def resolved_backend(self) -> str:
        """The process group's backend: the one given, else NCCL where CUDA is available, else gloo."""
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def resolved_checkpoint_url(self) -> str | None:
        return self.checkpoint_url or WorkerEnv.from_environ().checkpoint_url

    def resolved_local_every_steps(self) -> int | None:
        if self.local_every_steps is not None:
            return self.local_every_steps
        return WorkerEnv.from_environ().local_snapshot_every or None


# ``save_every``: the former name of ``save_every_seconds`` (it counts time, not steps), deprecated for one release:
# taken by the constructor and read back, with a DeprecationWarning; not a field (dataclasses.replace never sees it).
_dataclass_init = ElasticConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: ElasticConfig, *args: Any, save_every: timedelta | None = None, **kwargs: Any) -> None:
    if save_every is not None:
        warnings.warn(
            "ElasticConfig(save_every=) is deprecated: use save_every_seconds= (a duration; "
            "save_every_steps counts steps)",
            DeprecationWarning,
            stacklevel=2,
        )
        if kwargs.get("save_every_seconds") is not None:
            raise ValueError("give save_every_seconds, or its deprecated name save_every, not both")
        kwargs["save_every_seconds"] = save_every
    _dataclass_init(self, *args, **kwargs)


def _save_every(self: ElasticConfig) -> timedelta | None:
    warnings.warn("ElasticConfig.save_every is deprecated: read save_every_seconds", DeprecationWarning, stacklevel=2)
    return self.save_every_seconds


setattr(ElasticConfig, "__init__", _init)  # noqa: B010
setattr(ElasticConfig, "save_every", property(_save_every))  # noqa: B010


@dataclass(frozen=True)
class StepInfo:
    """One committed optimizer step, as seen by this rank (for progress hooks and sample accounting)."""

    step: int
    epoch: int
    rank: int
    world_size: int
    indices: Sequence[int]
    lr: float
    loss: float | None
    #: live recovery: the generation of the live group the step ran in (restart mode: None)
    generation: int | None = None
    #: live recovery: recorded after a re-form, for a step its group applied when a member failed (``rank``
    #: is then the rank it had in that step; for a member that died, a survivor records on its behalf)
    late: bool = False
