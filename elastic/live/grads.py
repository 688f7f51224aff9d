"""Data parallelism without DDP for live recovery: the loop's own gradient all-reduce, overlapped with backward.

A DDP wrapper keeps a reference to its process group inside its reducer, which outlives the wrapper: a torn
down gloo group then keeps its connections open, and a peer blocked in a collective with this worker waits
until the collective timeout instead of failing at once (seen in the chaos suite: a member that committed a
step, left behind for 600 s by the others' re-form). So in live mode the model is wrapped in
:class:`LiveDataParallel`, and :class:`GradientReducer` averages the gradients: a post-accumulate-grad hook
per parameter marks its gradient ready while the backward pass runs, and each bucket
(:mod:`elastic.live.buckets`: reverse parameter order, ~25 MiB) is all-reduced asynchronously as soon as it
and every bucket before it are complete, so communication overlaps the rest of the backward pass as DDP's
does. The work handles are waited at the step boundary (:meth:`GradientReducer.finish`), where a failure is
caught as for every other collective of the loop. As DDP does, each gradient is divided by the world size as it is
copied into its bucket (one pass), and, as DDP's ``gradient_as_bucket_view``, the averaged gradient is left in the
bucket: ``param.grad`` is a view into it after the step's all-reduce (no copy back). Buckets not complete by then (a
parameter unused on this rank, a backward that did not go through the wrapper) are launched there, in the same
order on every rank. Once a step has had a parameter without a gradient, the wrapper looks for unused parameters
after every forward (the autograd graph from its outputs, as DDP's ``find_unused_parameters``) and marks them ready
at once, so that one unused layer does not hold back every bucket behind it.

The reducer holds no process group: each bucket goes to the group current when it launches, and
:meth:`~GradientReducer.reset` (after a failure, before a re-form) drops the in-flight handles, so nothing
keeps a torn-down generation alive.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic.live.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, Bucket, assign_buckets

logger = logging.getLogger(__name__)

__all__ = [
    "BUCKET_BYTES",
    "GradientReadyTwiceError",
    "GradientReducer",
    "LiveDataParallel",
    "ReducerStats",
    "broadcast_module",
]


class GradientReadyTwiceError(RuntimeError):
    """A parameter's gradient was accumulated again after its bucket had been sent in the same step."""


@dataclass
class ReducerStats:
    """Buckets all-reduced so far: launched while the backward pass ran, or only at the step boundary."""

    steps: int = 0
    overlapped: int = 0
    at_boundary: int = 0


def _reachable_params(outputs: Any) -> set[int]:
    """The ids of the leaf tensors whose gradient a backward from ``outputs`` (tensors in any nesting of
    tuples, lists, dicts and dataclasses) accumulates."""
    stack: list[Any] = [outputs]
    nodes: list[Any] = []
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                nodes.append(o.grad_fn)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):  # as DDP's _find_tensors
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    seen: set[Any] = set()
    found: set[int] = set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


class GradientReducer:
    """Averages the gradients of ``module``'s trainable parameters over the current process group (see the
    module docstring). The parameters that require a gradient when it is created are the ones reduced."""

    def __init__(
        self, module: nn.Module, bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int | None = FIRST_BUCKET_BYTES
    ) -> None:
        self._module = module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._ids = {id(p) for p in self._params}
        self.buckets: list[Bucket] = assign_buckets(self._params, bucket_bytes, first_bucket_bytes)
        self._bucket_of = [0] * len(self._params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self._bucket_of[i] = b
        self._flat: list[torch.Tensor | None] = [None] * len(self.buckets)  # one buffer per bucket, kept
        self._views: list[list[torch.Tensor] | None] = [None] * len(self.buckets)  # its parameters' views
        self._scale: float | None = None  # 1 / the world size of this step's all-reduce
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
            for i, p in enumerate(self._params)
        ]
        self.stats = ReducerStats()
        self.find_unused = False  # set after a step in which a parameter had no gradient
        self._armed = False
        self._unused: set[int] = set()  # parameters marked ready after the forward: not in its graph
        self._ready = [False] * len(self._params)
        self._missing = [len(b.params) for b in self.buckets]
        self._next = 0  # the next bucket to launch: buckets go in index order on every rank
        self._works: list[tuple[int, Any]] = []

    # -- the backward pass ---------------------------------------------------------------------------
    def arm(self, outputs: Any = None) -> None:
        """The next backward pass is the step's last (a forward through the wrapper outside ``no_sync``,
        which returned ``outputs``): send each bucket as soon as its gradients are complete."""
        self._armed = True
        if self.find_unused and outputs is not None:
            reachable = _reachable_params(outputs)
            for i, p in enumerate(self._params):
                if id(p) not in reachable and not self._ready[i]:
                    self._unused.add(i)
                    self._mark_ready(i)

    @property
    def in_flight(self) -> int:
        """Buckets launched this step and not waited for yet."""
        return len(self._works)

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[index]
        if index in self._unused:
            raise GradientReadyTwiceError(
                f"parameter {index} {tuple(param.shape)} got a gradient but was not reachable from the outputs of "
                "the forward through trainer.model: compute the loss from what the forward returns"
            )
        if self._ready[index]:
            if b < self._next:
                raise GradientReadyTwiceError(
                    f"the gradient of parameter {index} {tuple(param.shape)} was accumulated again after its bucket"
                    " was all-reduced in this step: one backward per forward through trainer.model (use "
                    "trainer.model.no_sync() for all but the last)"
                )
            return  # not sent yet: the sum is what will be sent
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        self._missing[self._bucket_of[index]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self.stats.overlapped += 1
            self._next += 1

    def _launch(self, b: int) -> None:
        if self._scale is None:
            self._scale = 1.0 / dist.get_world_size()
        views = self._views_of(b)
        for i, view in zip(self.buckets[b].params, views, strict=True):
            grad = self._params[i].grad
            if grad is None:
                view.zero_()  # unused on this rank: takes part with zeros, gets the average
            elif grad is view:  # accumulated in place into last step's average (zero_grad(set_to_none=False))
                view.mul_(self._scale)
            else:  # divided while copied into the bucket: one pass, DDP's numerics (mul_out by 1 / world)
                torch.mul(grad, self._scale, out=view)
        flat = self._flat[b]
        assert flat is not None
        self._works.append((b, dist.all_reduce(flat, async_op=True)))

    def _views_of(self, b: int) -> list[torch.Tensor]:
        """The bucket's buffer (made at its first launch, or again after :meth:`reset` dropped it) and each of its
        parameters' views into it: what the parameter's gradient becomes once averaged."""
        views = self._views[b]
        if views is None:
            bucket = self.buckets[b]
            flat = self._flat[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            views = self._views[b] = [
                flat[offset : offset + self._params[i].numel()].view(self._params[i].shape)
                for i, offset in zip(bucket.params, bucket.offsets, strict=True)
            ]
        return views

    # -- the step boundary ---------------------------------------------------------------------------
    def finish(self, world_size: int) -> None:
        """Launch what is left, wait for every bucket and make the averages the gradients. A
        collective: every rank calls it once per step. Raises what a failed collective raises; the step's
        state is reset either way."""
        try:
            self._check_trainable()
            if self._armed and not self.find_unused and not all(self._ready):
                self.find_unused = True
                logger.info(
                    "live mode: %d parameter(s) had no gradient in a step; looking for unused parameters "
                    "after each forward from now on",
                    self._ready.count(False),
                )
            if self._scale is None:  # nothing launched during the backward pass
                self._scale = 1.0 / world_size
            while self._next < len(self.buckets):
                self._launch(self._next)
                self.stats.at_boundary += 1
                self._next += 1
            for _, work in self._works:
                work.wait()
            for b, _ in self._works:
                self._unpack(b)
            self._works = []  # all done: reset() keeps their buffers
            self.stats.steps += 1
        finally:
            self.reset()

    def _check_trainable(self) -> None:
        """A parameter unfrozen since the reducer was built would never be averaged (the ranks would drift
        apart): refuse it. One frozen since keeps its gradient None (:meth:`_unpack`)."""
        added = [name for name, p in self._module.named_parameters() if p.requires_grad and id(p) not in self._ids]
        if added:
            raise RuntimeError(
                f"live mode: parameter(s) {', '.join(added[:5])}{' ...' if len(added) > 5 else ''} require a "
                "gradient but did not when the trainer was built, so their gradients would not be averaged: "
                "set requires_grad before building the ElasticTrainer (a frozen parameter may be unfrozen only "
                "by building a new trainer)"
            )

    def _unpack(self, b: int) -> None:
        """The bucket's averages become its parameters' gradients: views into its buffer, no copy (DDP's
        ``gradient_as_bucket_view``). The next step's backward makes new gradients (``zero_grad()``) or adds into
        these (``set_to_none=False``); either way :meth:`_launch` writes the bucket before its all-reduce."""
        views = self._views[b]
        assert views is not None
        for i, view in zip(self.buckets[b].params, views, strict=True):
            p = self._params[i]
            if p.requires_grad:  # one frozen since the reducer was built keeps no gradient (an optimizer skips it)
                p.grad = view

    def reset(self) -> None:
        """Forget the step in progress (its in-flight work handles too): after a failure, before a re-form.
        The buffers of buckets still in flight are dropped (a late write by a torn-down generation's work then
        lands in a buffer nobody reads)."""
        for b, work in self._works:
            if not work.is_completed():
                views = self._views[b] or []
                for i, view in zip(self.buckets[b].params, views, strict=True):
                    if self._params[i].grad is view:  # a late write must not land in a gradient either
                        self._params[i].grad = None
                self._flat[b] = None
                self._views[b] = None
        self._armed = False
        self._scale = None
        self._unused = set()
        self._ready = [False] * len(self._params)
        self._missing = [len(b.params) for b in self.buckets]
        self._next = 0
        self._works = []

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.reset()


class LiveDataParallel(nn.Module):
    """The user's module in live mode (``.module`` and ``no_sync()`` as with DDP): a forward outside
    ``no_sync()`` with gradients enabled arms ``reducer`` for the backward pass that follows."""

    def __init__(self, module: nn.Module, reducer: GradientReducer | None = None) -> None:
        super().__init__()
        self.module = module
        self._reducer = reducer
        self._sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self._reducer is not None and self._sync and torch.is_grad_enabled():
            self._reducer.arm(out)
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of forwards in here accumulate locally; the next forward outside sends them all."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers rank ``src``'s (as DDP's constructor does)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src)
