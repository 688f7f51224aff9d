"""A step's loss, read on the host without draining the device's queue.

The loop reports each step's loss (the step hook's :class:`~elastic.train.config.StepInfo`, the progress
report, the loss log).  Reading it with ``float(loss)`` right after ``loss.backward()`` is a stream sync that
waits for the whole backward pass: the GPU then idles while the host launches the optimizer step and the next
step's forward, every step.  Here each micro-batch's loss is copied, *before* its backward is launched, into a
slot of a pinned host buffer on the current stream (``non_blocking``), and an event is recorded after it.  At the
step boundary :meth:`StepLoss.take` waits for that event only: the last micro-batch's forward pass, which the
device finished long before it gets through the backward pass and the optimizer step queued behind it.  So the
host reads the value while the device still has work queued, and it goes on launching the next step.

Off CUDA there is no queue: the slots are plain host memory and the copy is immediate.  The value is the same
either way: the sum over the micro-batches of ``loss * weight`` in float64 (``weight`` is the micro-batch's share
of the global batch), bit for bit what ``sum(float(loss) * weight)`` gives.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepLoss"]


class StepLoss:
    """The weighted sum of one step's micro-batch losses; see the module docstring."""

    def __init__(self) -> None:
        self._slots: torch.Tensor | None = None  # float64, pinned when the losses live on a CUDA device
        self._pinned = False
        self._weights: list[float] = []
        self._event: Any = None  # after the last slot's copy (CUDA), else None
        self._cuda_event: Any = None
        self._event_device: torch.device | None = None  # the device whose stream ``_cuda_event`` is recorded on

    def _slot(self, index: int, pinned: bool) -> torch.Tensor:
        slots = self._slots
        if slots is None or index >= slots.numel() or self._pinned != pinned:
            if self._event is not None:
                self._event.synchronize()  # this step's copies into the old slots land before those are read
            grown = torch.zeros(max(8, 2 * (index + 1)), dtype=torch.float64, pin_memory=pinned)
            if slots is not None and index and self._pinned == pinned:
                grown[:index].copy_(slots[:index])
            self._slots, self._pinned, slots = grown, pinned, grown
        return slots[index]

    def add(self, loss: torch.Tensor, weight: float) -> None:
        """Count ``loss`` (one value) with ``weight``; call it before the micro-batch's backward is launched."""
        if loss.numel() != 1:
            raise ValueError(f"the loss must be a single value (a scalar tensor), got shape {tuple(loss.shape)}")
        value = loss.detach().reshape(())
        index = len(self._weights)
        if value.is_cuda:
            slot = self._slot(index, pinned=True)
            slot.copy_(value.to(torch.float64), non_blocking=True)
            # the copy was queued on the current stream of the loss's device (not necessarily the current device)
            stream = torch.cuda.current_stream(value.device)
            if self._cuda_event is None or self._event_device != value.device:
                if self._event is not None:
                    self._event.synchronize()  # the other device's copies land before their slots are read
                self._cuda_event, self._event_device = torch.cuda.Event(), value.device  # recorded again per batch
            self._event = self._cuda_event
            self._event.record(stream)
        else:
            self._slot(index, pinned=False).copy_(value)
        self._weights.append(weight)

    def take(self) -> float | None:
        """The step's loss (None when no micro-batch counted one), and start the next step's."""
        weights, self._weights = self._weights, []
        event, self._event = self._event, None
        if not weights:
            return None
        if event is not None:
            event.synchronize()
        assert self._slots is not None
        values = self._slots[: len(weights)].tolist()
        total = 0.0
        for value, weight in zip(values, weights, strict=True):
            total += value * weight
        return total

    def discard(self) -> None:
        """Forget what this step counted (a live step dropped after a failure is served again)."""
        self._weights, self._event = [], None
