"""Where a job's training stands: its step, its data cursor and its LR policy with the ramp in force.

One home for the LR rule on resize: :meth:`TrainingCursor.resize` is what a restore from storage (a restart)
and a live re-form both call when the number of workers changed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from elastic.checkpoint.state import TrainingState
from elastic.contract.lr import LRPolicy, RampState
from elastic.train.registry import StateRegistry
from elastic.train.sampler import ElasticSampler

logger = logging.getLogger(__name__)

__all__ = ["TrainingCursor"]


class TrainingCursor:
    """The step, the :class:`~elastic.train.sampler.ElasticSampler`, the LR policy and its ramp, the world
    size they were last set for, and the user's registered state (:mod:`elastic.train.registry`). Every rank
    holds an equal one (it is saved and restored with the state)."""

    def __init__(
        self,
        policy: LRPolicy,
        sampler: ElasticSampler,
        rank: int,
        world_size: int,
        registry: StateRegistry | None = None,
    ) -> None:
        self.policy = policy
        self.sampler = sampler
        self.registry = registry if registry is not None else StateRegistry()
        self.step = 0
        self.world_size = world_size
        self.ramp: RampState = policy.start_ramp(0, policy.factor(world_size), world_size)
        sampler.set_world(rank, world_size)

    @property
    def lr_factor(self) -> float:
        return self.policy.factor_at(self.step, self.ramp)

    def resize(self, rank: int, world_size: int) -> None:
        """The workers are now ``world_size``: re-split the epoch's remaining samples and, if the size
        changed, ramp the LR factor from the one in force to the policy's factor for the new size."""
        self.sampler.set_world(rank, world_size)
        if world_size == self.world_size:
            return
        in_force = self.policy.factor_at(self.step, self.ramp)
        self.ramp = self.policy.start_ramp(self.step, in_force, world_size)
        logger.info(
            "resized %d -> %d workers at step %d: LR factor %.6g -> %.6g over %d steps",
            self.world_size,
            world_size,
            self.step,
            in_force,
            self.ramp.target_factor,
            self.policy.warmup_steps,
        )
        self.world_size = world_size

    def state(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~elastic.checkpoint.capture_training_state` this cursor fills."""
        return {
            "data_cursor": {"sampler": self.sampler.state_dict()},
            "lr_reference": self.policy.reference(),
            "extras": {"lr_ramp": dataclasses.asdict(self.ramp), "registered": self.registry.state()},
            "world_size": self.world_size,
        }

    def load(self, ts: TrainingState, rank: int, world_size: int) -> None:
        """Take the cursor of a restored or received state, then :meth:`resize` to ``world_size``."""
        self.step = ts.step
        self.sampler.load_state_dict(dict(ts.data_cursor)["sampler"])
        if ts.lr_reference:
            stored = LRPolicy.from_reference(dict(ts.lr_reference))
            if stored != self.policy:
                logger.warning("using the LR policy stored in the checkpoint (%s), not %s", stored, self.policy)
            self.policy = stored
        saved_ramp = dict(ts.extras).get("lr_ramp")
        if saved_ramp:
            self.ramp = RampState(**saved_ramp)
        self.registry.load(dict(ts.extras).get("registered") or {})
        self.world_size = ts.world_size
        self.resize(rank, world_size)
