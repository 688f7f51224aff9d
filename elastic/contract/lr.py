"""LR policy on resize: pure rules, computed from the job's reference values, never compounded.

A job declares once: the rule, the base LR, the base world size and the base per-worker batch. For any
world size the policy gives the LR scale factor and the step plan (samples per optimizer step, gradient
accumulation). On a resize, an optional warmup ramps the factor linearly from its value at the resize to the
new target over ``warmup_steps`` optimizer steps.

Rules (``f`` is the factor applied to the base LR, ``W`` the world size, ``W0`` the base world size):

``linear``               ``f = W / W0`` (Goyal et al.: the global batch grows with W, so does the LR)
``sqrt``                 ``f = sqrt(W / W0)``
``none``                 ``f = 1``
``fixed-global-batch``   ``f = 1`` and the global batch stays ``G = W0 * b0 * A``: each optimizer step
                         accumulates gradients over ``ceil(G / (W * b0))`` micro-batches (``no_sync`` on all but
                         the last)

``A`` is the policy's ``accumulation_steps`` (default 1): the micro-batches of ``b0`` samples each worker
accumulates per optimizer step at the base world size. Under ``linear``, ``sqrt`` and ``none`` the global batch
is ``W * b0 * A`` with ``A`` micro-batches at every world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the rules are pure: the job service validates job specs with them, without torch
    from torch.optim import Optimizer

__all__ = ["LRPolicy", "LRRule", "RampState", "StepPlan"]


class LRRule(str, Enum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"
    FIXED_GLOBAL_BATCH = "fixed-global-batch"


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step consumes at a given world size."""

    global_batch: int  # samples per optimizer step, all ranks together
    accumulation_steps: int  # micro-batches per rank per optimizer step
    micro_batch: int  # upper bound of one micro-batch per rank


@dataclass(frozen=True)
class RampState:
    """A warmup in progress: from ``start_factor`` at ``start_step`` to the target over the policy's steps."""

    start_step: int
    start_factor: float
    target_factor: float


@dataclass(frozen=True)
class LRPolicy:
    """The job's LR policy and its reference values (stored in every checkpoint).

    The one shape of a policy: the job service builds it from a job spec's ``lr_policy`` and hands it to the
    workers as the JSON of :meth:`reference` in ``ETRAIN_LR_POLICY`` (see :mod:`elastic.contract.env`)."""

    rule: LRRule
    base_lr: float
    base_world_size: int
    base_batch_per_worker: int
    warmup_steps: int = 0
    #: micro-batches of ``base_batch_per_worker`` samples per worker and optimizer step at the base world size
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.rule, LRRule):
            object.__setattr__(self, "rule", LRRule(self.rule))
        if self.base_lr <= 0:
            raise ValueError("base_lr must be positive")
        if self.base_world_size < 1 or self.base_batch_per_worker < 1:
            raise ValueError("base_world_size and base_batch_per_worker must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.accumulation_steps < 1:
            raise ValueError("accumulation_steps must be >= 1")

    # -- pure rules ----------------------------------------------------------------------------------
    def factor(self, world_size: int) -> float:
        """The target LR factor for ``world_size`` (relative to ``base_lr``)."""
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        ratio = world_size / self.base_world_size
        if self.rule is LRRule.LINEAR:
            return ratio
        if self.rule is LRRule.SQRT:
            return math.sqrt(ratio)
        return 1.0

    def target_lr(self, world_size: int) -> float:
        return self.base_lr * self.factor(world_size)

    def step_plan(self, world_size: int) -> StepPlan:
        """What one optimizer step consumes with ``world_size`` workers (see the module docstring)."""
        b0, a = self.base_batch_per_worker, self.accumulation_steps
        if self.rule is LRRule.FIXED_GLOBAL_BATCH:
            g = self.base_world_size * b0 * a
            return StepPlan(global_batch=g, accumulation_steps=math.ceil(g / (world_size * b0)), micro_batch=b0)
        return StepPlan(global_batch=world_size * b0 * a, accumulation_steps=a, micro_batch=b0)

    # -- warmup ramp ---------------------------------------------------------------------------------
    def start_ramp(self, step: int, current_factor: float, world_size: int) -> RampState:
        """A resize at ``step``: ramp from the factor in force (``current_factor``) to the new target."""
        return RampState(start_step=step, start_factor=current_factor, target_factor=self.factor(world_size))

    def factor_at(self, step: int, ramp: RampState) -> float:
        """The factor in force for optimizer step ``step`` (0-based count of steps taken so far)."""
        if self.warmup_steps == 0:
            return ramp.target_factor
        done = min(max(step - ramp.start_step + 1, 0), self.warmup_steps)
        return ramp.start_factor + (ramp.target_factor - ramp.start_factor) * done / self.warmup_steps

    # -- persistence ---------------------------------------------------------------------------------
    def reference(self) -> dict[str, Any]:
        out = asdict(self)
        out["rule"] = self.rule.value
        return out

    @classmethod
    def from_reference(cls, ref: dict[str, Any]) -> LRPolicy:
        return cls(
            rule=LRRule(ref["rule"]),
            base_lr=float(ref["base_lr"]),
            base_world_size=int(ref["base_world_size"]),
            base_batch_per_worker=int(ref["base_batch_per_worker"]),
            warmup_steps=int(ref.get("warmup_steps", 0)),
            accumulation_steps=int(ref.get("accumulation_steps", 1)),
        )


@contextmanager
def scaled_lr(optimizer: Optimizer, factor: float) -> Iterator[None]:
    """Multiply every param group's LR by ``factor`` for the duration of the block (``optimizer.step()``),
    then put the scheduler's own values back, so a chainable LR scheduler never sees (and never compounds)
    the elastic factor."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
