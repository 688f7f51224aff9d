"""Live recovery (see :mod:`elastic.train.strategy` for the interface): :class:`LiveGroupRecovery`, what a failure
does when the survivors re-form in process (for replicated and sharded models alike), and
:class:`LiveReplicatedStrategy`, the replicated model's strategy.

:class:`LiveGroupRecovery` registers the worker in its job's live group and waits to be a member of a generation
(:func:`~elastic.train.live.join_live_group`); :class:`~elastic.train.live.LiveRecovery` then brings the worker's state
to each generation's (restored from a snapshot at the founding, received from a member otherwise) and records each
step once it commits. A collective that fails because a peer was lost drops the step in progress (its optimizer steps
become no-ops) instead of raising; the loop then re-forms over the survivors (:meth:`LiveGroupRecovery.reform`) and
serves the step again. See docs/live-recovery.md.

:class:`LiveReplicatedStrategy` wraps the module in :class:`~elastic.live.grads.LiveDataParallel`, not DDP: DDP's
reducer would keep a torn-down generation's connections open (see :mod:`elastic.live.grads`); the loop's
:class:`~elastic.live.grads.GradientReducer` holds no process group, so one serves every generation. It all-reduces
the gradients overlapped with the last micro-batch's backward; they are complete at
:meth:`~LiveReplicatedStrategy.finish_gradients`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

from torch import nn

from elastic.checkpoint.state import TrainingState
from elastic.live.grads import GradientReducer, LiveDataParallel
from elastic.live.group import LiveGroup, is_peer_failure
from elastic.live.protocol import Generation, ReformReason
from elastic.train.config import ElasticConfig, StepInfo
from elastic.train.live import LiveRecovery, join_live_group
from elastic.train.parallel import ShardedModel
from elastic.train.strategy import LoopParts, ParallelStrategy, Recovery, capture_replicated

logger = logging.getLogger(__name__)

__all__ = ["LiveGroupRecovery", "LiveReplicatedStrategy"]


class LiveGroupRecovery(Recovery):
    """See the module docstring. A step's record is written when it commits (a step applied by some members only
    when the group broke is recorded late, after the re-form: :class:`~elastic.train.live.LiveRecovery`)."""

    live = True
    storage_required = False  # a joiner takes its state from a peer; saves retry under save_failure_grace

    def __init__(self, config: ElasticConfig) -> None:
        self._config = config
        self._group: LiveGroup | None = None
        self._first: Generation | None = None  # the generation joined, until start syncs with it
        self._live: LiveRecovery | None = None
        self._parts: LoopParts | None = None
        self._broken: BaseException | None = None  # a collective of this step failed

    @property
    def group(self) -> LiveGroup:
        if self._group is None:
            raise RuntimeError("the live group is joined first (LiveGroupRecovery.join)")
        return self._group

    @property
    def _recovery(self) -> LiveRecovery:
        if self._live is None:
            raise RuntimeError("live recovery is started first (LiveGroupRecovery.start)")
        return self._live

    def join(self, config: ElasticConfig, granularity: int) -> None:
        self._group, self._first = join_live_group(config, granularity=granularity)

    def start(self, parts: LoopParts, state: nn.Module | ShardedModel, restore: Callable[[int, int], bool]) -> None:
        """Make this member's state the first generation's (restored at its founding, else received from a member;
        replicas made identical), share the snapshot schedule, and start the group's watchdog."""
        assert self._first is not None
        self._parts = parts
        group = self.group
        shared = (parts.checkpoints.share_schedule, parts.checkpoints.adopt_schedule)
        self._live = LiveRecovery(
            group,
            state,
            parts.optimizer,
            parts.scheduler,
            parts.cursor,
            parts.device,
            parts.record,
            restore,
            shared=shared,
        )
        self._live.after_generation(self._first)
        self._first = None
        options = self._config.live
        group.start_watchdog(options.stuck_grace or options.ttl + timedelta(seconds=2))

    @property
    def generation(self) -> int | None:
        gen = self._group.generation if self._group is not None else None
        return gen.number if gen is not None else None

    def begin_step(self, info: StepInfo, global_batch: int) -> None:
        self._recovery.begin(info, global_batch)

    def step_applied(self, lr: float, loss: float | None) -> None:
        self._recovery.applied(lr, loss)

    def step_committed(self) -> None:
        self._recovery.committed()

    def joiners_waiting(self, rank: int) -> bool:
        return self._recovery.joiners_waiting(rank)

    def peer_failed(self, exc: RuntimeError) -> bool:
        """A lost peer (:func:`~elastic.live.group.is_peer_failure`) marks the step dropped, logged once."""
        if self._live is None or not is_peer_failure(exc):
            return False
        if self._broken is None:
            assert self._parts is not None
            logger.warning(
                "live group: a collective of step %d failed (%s); re-forming",
                self._parts.cursor.step + 1,
                str(exc).splitlines()[0][:200],
            )
            self._broken = exc
        return True

    @property
    def dropped(self) -> bool:
        return self._broken is not None

    def reform(self, reason: ReformReason) -> bool:
        """Re-form (after a failure, to admit joiners, or without SIGTERM'd members) and take the new generation's
        state; a sharded save still in flight is waited for (admit) or given up (a failure) first, since it uses the
        old group. Falls back to the restart path (exit) when no group can form: see
        :meth:`~elastic.train.live.LiveRecovery.recover`."""
        live, parts = self._recovery, self._parts
        assert parts is not None
        parts.checkpoints.before_reform(admit=reason is ReformReason.ADMIT)
        live.recover(reason)
        self._broken = None
        return True

    def leave(self, finished: bool) -> None:
        """Revoke this worker's lease: the others re-form without waiting for it."""
        if self._live is not None:
            self._live.group.close(finished=finished)


class LiveReplicatedStrategy(ParallelStrategy):
    """See the module docstring. ``model``: the plain module (not wrapped in DDP: the factory refuses it)."""

    def __init__(self, model: nn.Module, config: ElasticConfig) -> None:
        super().__init__(config, LiveGroupRecovery(config))
        self._module = model
        self._reducer: GradientReducer | None = None  # made at the first wrap; serves every generation
        self._model: LiveDataParallel | None = None

    def start(self, parts: LoopParts) -> nn.Module:
        self._parts = parts
        self._module = self._module.to(parts.device)
        self.recovery.start(parts, self._module, self._restore)
        return self.wrap()

    @property
    def module(self) -> nn.Module:
        return self._module

    def wrap(self) -> nn.Module:
        if self._reducer is None:
            self._reducer = GradientReducer(self._module)
        self._model = LiveDataParallel(self._module, self._reducer)
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        assert self._model is not None
        return self._model.no_sync()

    def finish_gradients(self, world_size: int) -> None:
        """Wait for the all-reduce of every bucket and write the averages into the gradients (a collective)."""
        if self._reducer is not None:
            self._reducer.finish(world_size)

    def capture(self, step: int) -> TrainingState:
        return capture_replicated(step, self._module, self.parts)

    def reform(self, reason: ReformReason) -> bool:
        if self._reducer is not None:
            self._reducer.reset()  # the dropped step's in-flight buckets belong to the broken group
        return super().reform(reason)

    def close(self) -> None:
        """Remove the reducer's hooks: the user's module keeps none of ours."""
        if self._reducer is not None:
            self._reducer.close()
