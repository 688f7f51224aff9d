"""One optimizer step of the loop as the user's code sees it (:class:`Step`), and the gate on the user's
optimizers (:class:`OptimizerGate`).

The own-step form of the loop (``trainer.steps()``) hands the user a :class:`Step`; the script writes the
step's body itself::

    for step in trainer.steps(max_steps=5000):
        for x, y in step:                                   # this rank's micro-batches (no_sync but the last)
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x, y)
            step.backward(loss, scaler)                     # or scaler.scale(loss * step.weight).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                              # the LR factor is applied around it
        scaler.update()

What the loop keeps: the accumulation boundaries (how many micro-batches, ``no_sync`` on all but the last), the
weight of each micro-batch's loss (:attr:`Step.weight`: the summed gradients, averaged over the ranks, are the
exact mean over the step's samples, whatever the split), the LR policy's factor around each ``optimizer.step()``
(:class:`OptimizerGate`), and the commit point: when the script asks for the next step, every rank agrees that
the step's body ran, with as many optimizer steps on every rank (a step that ran on some ranks only is an
error on all of them; one that ran on none, as a ``GradScaler`` skips a step with non-finite gradients, is a
skipped step and commits). In live mode a step whose group broke (a peer lost in its collectives) is dropped:
the gate turns the body's ``optimizer.step()`` calls into no-ops, and the loop re-forms and serves the step again.
A collective of the script's own in the body (a metric's all-reduce, FSDP's ``clip_grad_norm_``) is covered when
the body runs under ``with step:`` (a lost peer there drops the step too, and the rest of the body is skipped);
outside it, its error ends the worker (the restart path).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from elastic.contract.lr import scaled_lr
from elastic.train.sampler import StepLayout

logger = logging.getLogger(__name__)

__all__ = ["OptimizerGate", "Step", "StepHost", "StepMismatchError", "as_optimizers", "steps_end"]


class StepMismatchError(RuntimeError):
    """The ranks disagree about a step: its optimizer steps ran on some ranks and not on others."""


@dataclass(frozen=True)
class StepHost:
    """What a :class:`Step` asks of the loop (the trainer's methods, bound to it)."""

    no_sync: Callable[[], AbstractContextManager[Any]]  # no gradient all-reduce for the micro-batch inside
    fetch: Callable[[StepLayout], Iterator[Any]]  # the step's micro-batches
    gradients_done: Callable[[], None]  # the last micro-batch's backward ran: complete the step's gradients
    run_backward: Callable[[torch.Tensor, float, bool, Any], None]  # (loss, weight, padding, scaler)
    broken: Callable[[], bool]  # live mode: the group broke during the step
    peer_lost: Callable[[RuntimeError], bool]  # live mode: the error of a collective is a lost peer (the step drops)


class Step:
    """One optimizer step: iterate it for this rank's micro-batches, then step the optimizer(s) as the script
    does. See the module docstring.

    Attributes:
        index: the step's number once it commits (the trainer's ``step`` is ``index - 1`` while it runs).
        epoch: the epoch its samples come from.
        indices: this rank's samples of the step (their indices in the data set).
        accumulation: the micro-batches this rank runs (the LR policy's plan for this world).
        global_batch: the step's samples, all ranks together.
        world_size: the workers it runs on.
    """

    def __init__(self, host: StepHost, layout: StepLayout, index: int, epoch: int, world_size: int) -> None:
        self._host, self._layout = host, layout
        self.index, self.epoch, self.world_size = index, epoch, world_size
        self.indices: Sequence[int] = layout.indices
        self.accumulation = len(layout.micro)
        self.global_batch = layout.total
        self._current = -1  # the micro-batch being served
        self._done = False  # every micro-batch served, gradients complete
        self._backward_calls = 0

    @property
    def weight(self) -> float:
        """The factor of the current micro-batch's loss (a mean over its samples) that makes the gradient the exact
        mean over the step's samples: ``1 / accumulation`` for equal micro-batches, 0 for a pad micro-batch."""
        if self._current < 0:
            raise RuntimeError("step.weight is the current micro-batch's: iterate the step first")
        return self._layout.weight(self._current, self.world_size)

    @property
    def micro_batch(self) -> int:
        """The index of the micro-batch being served (0-based)."""
        return self._current

    @property
    def dropped(self) -> bool:
        """Live mode: the group broke during this step; it is served again after the re-form (its optimizer steps
        are no-ops)."""
        return self._host.broken()

    @property
    def complete(self) -> bool:
        """Whether all the step's micro-batches were served (and their gradients synchronized)."""
        return self._done

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        """``with step:`` around the step's body: in live mode a peer lost in a collective of the script's own drops
        the step, as one lost in backward does (the rest of the body is skipped; its optimizer steps would be no-ops
        anyway), and the loop re-forms and serves the step again. Any other error is raised."""
        return isinstance(exc, RuntimeError) and self._host.peer_lost(exc)

    def __iter__(self) -> Iterator[Any]:
        if self._current >= 0:
            raise RuntimeError(f"step {self.index}'s micro-batches are served once")
        last = self.accumulation - 1
        batches = self._host.fetch(self._layout)
        for j in range(self.accumulation):
            if self._host.broken():
                break
            self._current = j
            ctx = self._host.no_sync() if j < last else None
            if ctx is not None:
                ctx.__enter__()
            try:
                yield next(batches)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        if not self._host.broken():
            self._host.gradients_done()
        self._done = True

    def backward(self, loss: torch.Tensor, scaler: Any = None) -> None:
        """``(loss * weight).backward()`` for the current micro-batch (``loss``: its mean loss, unscaled; it is
        also what the loop reports), through ``scaler.scale`` when a ``GradScaler`` is given; in live mode a lost
        peer in its collectives drops the step instead of raising."""
        if self._current < 0:
            raise RuntimeError("step.backward(loss) belongs to a micro-batch: iterate the step first")
        self._backward_calls += 1
        padding = not self._layout.micro[self._current]
        self._host.run_backward(loss, self.weight, padding, scaler)


class OptimizerGate:
    """The loop's hold on the user's optimizers: each one's ``step`` is wrapped (on the instance, so that a
    ``GradScaler`` or an LR scheduler wrapping it too still goes through it) to apply the LR factor around the
    step (:func:`~elastic.contract.lr.scaled_lr`: a scheduler never sees the factor), to count the steps of
    the current loop step, and to do nothing while the step is dropped (live mode)."""

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], factor: Callable[[], float], dropped: Callable[[], bool]
    ) -> None:
        self.optimizers = tuple(optimizers)
        self._factor, self._dropped = factor, dropped
        self.count = 0
        self._originals: list[tuple[torch.optim.Optimizer, Any, bool]] = []
        for opt in self.optimizers:
            own = "step" in vars(opt)
            original = opt.step
            opt.step = self._wrap(opt, original)  # type: ignore[method-assign]
            self._originals.append((opt, original if own else None, own))

    def _wrap(self, opt: torch.optim.Optimizer, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(this: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if self._dropped():
                logger.debug("optimizer step of a dropped step: not applied")
                return None
            with scaled_lr(this, self._factor()):
                out = original(*args, **kwargs)
            self.count += 1
            return out

        step.__wrapped__ = original  # type: ignore[attr-defined]
        # a bound method, as torch's LR schedulers expect of ``optimizer.step`` when they wrap it in turn
        return types.MethodType(step, opt)

    def take(self) -> int:
        """The optimizer steps since the last call."""
        n, self.count = self.count, 0
        return n

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Put each optimizer's own ``step`` back."""
        for opt, original, own in self._originals:
            if own:
                opt.step = original  # type: ignore[method-assign]
            else:
                vars(opt).pop("step", None)
        self._originals = []


def steps_end(
    epoch: int | None, epochs: int | None, max_steps: int | None, current_epoch: int, stream: bool
) -> int | None:
    """The epoch the loop's steps end before (None: ``max_steps`` alone ends them), from the arguments of
    ``trainer.steps()``/``batches()``; a clear error for arguments that do not say where the steps end."""
    if epoch is not None and epochs is not None:
        raise TypeError("give an epoch or epochs=N, not both")
    if epoch is None and epochs is None and max_steps is None:
        raise TypeError("give an epoch, epochs=N or max_steps=N")
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    if stream and max_steps is None:
        raise ValueError("a stream has no epochs for the loop: give max_steps")
    if epoch is not None and epoch > current_epoch:
        raise ValueError(f"epoch {epoch} asked for while epoch {current_epoch} is not finished")
    return epochs if epochs is not None else None if epoch is None else epoch + 1


def as_optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """The trainer's ``optimizer`` argument as a tuple: one optimizer, or a non-empty sequence of them."""
    optimizers = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("optimizer must be a torch.optim.Optimizer or a sequence of them")
    return optimizers
