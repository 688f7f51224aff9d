"""Staging: taking a consistent copy of a state's tensors so that training can go on while it is written.

:meth:`Stager.flatten` splits a state into its structure (the skeleton) and its tensors, and copies the
tensors into host buffers that are kept and reused from one save to the next (same index, shape and dtype).

- CPU tensors go into ordinary (pageable) buffers: at once, or, for those ``defer`` selects, in the writer
  thread (:meth:`FlatState.finish_staging`); the optimizer fence then waits for that on the host (``staged``).
- CUDA tensors go into page-locked (pinned) buffers, ``pinned_limit_bytes`` of them at most, by
  ``non_blocking`` copies on one copy stream per device, ordered after the work already queued on the current
  stream and tracked by CUDA events.  Nothing waits on the host: tensors not deferred are copied first and the
  current stream waits (GPU-side) for them at once, so the next forward cannot change them (BatchNorm
  statistics) before they are copied; deferred tensors (the optimizer's) are copied after, under the next
  forward/backward, and :meth:`FlatState.fence` orders the optimizer's step after them (GPU-side too).  The
  writer thread synchronizes on the events before it reads a byte.  Beyond the cap, or once pinning has
  failed, CUDA tensors are staged in pageable memory, whose copies block the host (one warning says so).
- Device-side staging (a ``device_pool``, see ``device_staging``): CUDA tensors whose device has room beyond
  a margin are first copied into reused buffers on the device (device-to-device: what the events above, and
  so the fences, wait for), then drained from there to their pinned buffers on the same copy stream, behind
  the fenced copies; the writer waits for the drain.  Tensors that do not fit are copied straight to the host
  as above, per tensor.  Streams and events go through :class:`~elastic.checkpoint.device_copy.CopyOps`.
- :meth:`Stager.warm` allocates those buffers ahead of the first save (``CheckpointManager.prepare``).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.checkpoint.codec import TENSOR_REF_KEY
from elastic.checkpoint.device_copy import CopyOps, CudaCopyOps, QueuedCopy, StagingEvent
from elastic.checkpoint.device_staging import DeviceBufferPool, StageRequest, format_bytes, tensor_bytes
from elastic.checkpoint.tree import map_leaves

__all__ = ["FlatState", "Stager", "tensor_signature"]

logger = logging.getLogger(__name__)


@dataclass
class FlatState:
    """A state split into its structure (``skeleton``) and the tensors it references, in order.

    ``pending`` tensors are still the live (CPU) sources: ``finish_staging`` (run by the writer thread)
    copies them into staging buffers and then sets ``staged``.  Staging buffers of CUDA tensors are being
    filled by the device until ``finish_staging`` has synchronized on ``copy_events`` (the last copy of each
    device); ``fence_events`` mark the end of the deferred device copies (what the optimizer fence waits for).
    """

    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    staged: threading.Event = field(default_factory=threading.Event)
    stager: Stager | None = None
    copy_events: dict[int, StagingEvent] = field(default_factory=dict)  # device index -> last copy (or drain)
    fence_events: dict[int, StagingEvent] = field(default_factory=dict)
    device_staged: tuple[int, ...] = ()  # indices copied device-to-device first, then drained to the host
    device_copies_done: bool = False

    def finish_staging(self) -> None:
        """Before any byte is read (writer thread): copy the deferred CPU tensors and set ``staged`` (even if
        copying fails), then wait until the device-to-host copies have landed."""
        try:
            if self.pending and self.stager is not None:
                for index in self.pending:
                    self.tensors[index] = self.stager._copy(index, self.tensors[index])
            self.pending = []
        finally:
            self.staged.set()
        for event in self.copy_events.values():
            event.wait()  # the drain of device-staged tensors included: raises if a copy failed
        self.device_copies_done = True

    def fence(self) -> bool:
        """Order what comes next (the optimizer's step) after the deferred copies: on the GPU for CUDA
        tensors (the current stream waits for their events; the host does not), on the host for CPU ones.
        Returns whether there was anything to wait for."""
        acted = False
        if self.fence_events and not self.device_copies_done and self.stager is not None:
            for device, event in self.fence_events.items():
                self.stager.ops.order_after(device, event)
            acted = True
        if not self.staged.is_set():
            self.staged.wait()
            acted = True
        return acted

    @property
    def tensor_bytes(self) -> int:
        return sum(tensor_bytes(t) for t in self.tensors)


def _packable(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_quantized


def _pinned_cost(nbytes: int) -> int:
    """Page-locked bytes torch's caching host allocator holds for a block of ``nbytes`` (rounded up to a power
    of two by default)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass
class _Buffer:
    tensor: torch.Tensor
    pinned: bool


class Stager:
    """Splits a state into skeleton + tensors and copies the tensors into reused host buffers.

    A buffer is reused by the next ``flatten`` whose tensor at the same index has the same shape and dtype
    (allocating and faulting in fresh memory, let alone pinning it, costs far more than the copy itself).
    ``pinned_limit_bytes`` caps the page-locked memory held for CUDA tensors (0: never pin).  A caller must
    not flatten again while a previous result is still being written (the manager keeps one save in flight).
    """

    def __init__(
        self,
        reuse_buffers: bool = True,
        pinned_limit_bytes: int = 0,
        *,
        ops: CopyOps | None = None,
        device_pool: DeviceBufferPool | None = None,
    ) -> None:
        """``ops``: copy streams and events (default CUDA's); ``device_pool``: device buffers for device-side
        staging (None: CUDA tensors are always copied straight to the host)."""
        self._ops: CopyOps = ops if ops is not None else CudaCopyOps()
        self._pool = device_pool
        self.host_allocations = 0  # host staging buffers allocated so far (a warm save allocates none)
        self._reuse = reuse_buffers
        self._pinned_limit = pinned_limit_bytes
        self._buffers: list[_Buffer | None] = []
        self._pinned_held = 0
        self._pin_error: str | None = None  # pinning failed once: never tried again
        self._warned = False
        self._said_unpinned = False  # logged once: device-side staging skipped for want of pinned buffers

    @property
    def ops(self) -> CopyOps:
        return self._ops

    @property
    def device_pool(self) -> DeviceBufferPool | None:
        return self._pool

    @property
    def pinned_bytes(self) -> int:
        """Page-locked memory held by the staging buffers (as torch's allocator rounds it)."""
        return self._pinned_held

    def flatten(self, state: Any, *, copy: bool, defer: Callable[[torch.Tensor], bool] | None = None) -> FlatState:
        """Split ``state``.  With ``copy``, CPU tensors are copied now, except those ``defer`` selects (but
        scalars), which are left for ``FlatState.finish_staging`` (the caller then must not change them until
        ``staged``).
        CUDA tensors are always staged through the device copy streams (see the module docstring); with
        ``copy`` the current stream is made to wait for those ``defer`` does not select, and
        ``FlatState.fence`` orders later work after the others.  Without ``copy`` (a blocking save) CPU
        tensors are referenced as they are, and nothing but ``finish_staging`` waits for the device copies."""
        flat = FlatState(skeleton=None, stager=self)
        flat.skeleton, sources = _split(state, copy=copy)
        self._trim(len(sources))
        early: list[int] = []  # CUDA tensors copied first, fenced at once
        late: list[int] = []  # CUDA tensors ``defer`` selects, fenced at the optimizer's step
        copy_now: list[int] = []
        for index, src in enumerate(sources):
            deferred = copy and defer is not None and defer(src)
            flat.tensors.append(src)  # replaced by its staging buffer below, or by finish_staging
            if self._ops.device_of(src) is not None:
                (late if deferred else early).append(index)
            elif not copy:
                flat.tensors[index] = _as_cpu(src)
            elif deferred and src.numel() > 1:  # scalars (Adam's CPU step counts) now: a fence need not wait
                flat.pending.append(index)
            else:
                copy_now.append(index)
        if early or late:
            self._stage_device(flat, sources, early, late, order_now=copy)
        for index in copy_now:  # host copies run while the device copies are under way
            flat.tensors[index] = self._copy(index, sources[index])
        if not flat.pending:
            flat.staged.set()
        return flat

    def warm(self, state: Any) -> None:
        """Allocate the buffers a (background) save of ``state`` will use without copying anything: pinned
        host buffers and, as memory allows, device buffers for its device tensors; for host tensors, pageable
        buffers with their pages touched.  A save of a state with the same tensors then allocates nothing.
        Not concurrently with a save (the manager orders them)."""
        _, sources = _split(state, copy=False)
        self._trim(len(sources))
        indices = [i for i, src in enumerate(sources) if self._ops.device_of(src) is not None]
        for index, src in enumerate(sources):
            slot = self._slot(index)
            if self._ops.device_of(src) is None and (slot is None or not self._fits(slot, src)):
                self._put(index, self._host_empty(src).zero_(), pinned=False)  # zero_: faults the pages in now
        if indices:
            devices = {index: self._device(sources[index]) for index in indices}
            buffers = self._device_buffers(sources, indices)
            self._plan_device(sources, indices, devices, buffers)

    # -- host (CPU) tensors ---------------------------------------------------------------------------
    def _copy(self, index: int, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        slot = self._slot(index)
        if slot is None or not self._fits(slot, src):
            slot = self._put(index, self._host_empty(src), pinned=False)
        slot.tensor.copy_(src)
        return slot.tensor

    # -- device (CUDA) tensors -------------------------------------------------------------------------
    def _stage_device(
        self, flat: FlatState, sources: list[torch.Tensor], early: list[int], late: list[int], *, order_now: bool
    ) -> None:
        devices = {index: self._device(sources[index]) for index in early + late}
        buffers = self._device_buffers(sources, early + late)
        staged: set[int] = set()
        if order_now:  # a blocking save waits for the host copies anyway: no device buffers for it
            staged = set(self._plan_device(sources, early + late, devices, buffers))
        flat.device_staged = tuple(sorted(staged))
        begun: set[int] = set()
        for group, deferred in ((early, False), (late, True)):
            if not group:
                continue
            events = self._issue(sources, group, devices, buffers, staged, begun)
            flat.copy_events.update(events)  # per device, the later event covers the earlier (one stream)
            if deferred:
                flat.fence_events = events
            elif order_now:
                for device, event in events.items():  # the next forward must not change them before copied
                    self._ops.order_after(device, event)
        if staged:
            flat.copy_events.update(self._drain(sorted(staged), devices, buffers))
        for index, buf in buffers.items():
            flat.tensors[index] = buf.tensor

    def _device(self, t: torch.Tensor) -> int:
        device = self._ops.device_of(t)
        assert device is not None
        return device

    def _plan_device(
        self, sources: list[torch.Tensor], indices: list[int], devices: dict[int, int], buffers: dict[int, _Buffer]
    ) -> tuple[int, ...]:
        """The indices to copy device-to-device first (see ``device_staging``): those whose host buffer can be
        drained into without blocking (pinned, where the device needs it), while device memory allows."""
        if self._pool is None:
            return ()
        # zero-element tensors have nothing to stage and never get a pinned buffer (nothing to pin): counted
        # as left without one, they took the once-only line below with a wrong reason ("capped" under the cap)
        indices = [i for i in indices if sources[i].numel() > 0]
        eligible = [i for i in sorted(indices) if buffers[i].pinned or not self._ops.needs_pinned_host]
        if len(eligible) < len(indices) and self._pool.settings.enabled and not self._said_unpinned:
            self._said_unpinned = True
            logger.info(
                "checkpoint staging: %d of %d CUDA tensors are copied straight to the host, not device-side: "
                "they have no pinned host buffer to drain into (pinned_staging_bytes=%s, pinning %s)",
                len(indices) - len(eligible),
                len(indices),
                format_bytes(self._pinned_limit),
                f"failed: {self._pin_error}" if self._pin_error is not None else "capped",
            )
        requests = [StageRequest.of(i, devices[i], sources[i]) for i in eligible]
        if not requests:
            return ()
        return self._pool.ensure(requests).staged

    def _issue(
        self,
        sources: list[torch.Tensor],
        group: list[int],
        devices: dict[int, int],
        buffers: dict[int, _Buffer],
        staged: set[int],
        begun: set[int],
    ) -> dict[int, StagingEvent]:
        """Queue the copies of ``group`` on each device's copy stream (device-to-device ones first, then the
        direct device-to-host ones); return one event per device after them (what a fence waits for)."""
        by_device: dict[int, list[int]] = {}
        for index in group:
            by_device.setdefault(devices[index], []).append(index)
        events: dict[int, StagingEvent] = {}
        for device, indices in by_device.items():
            if device not in begun:  # the copies see every write queued before save
                self._ops.begin(device)
                begun.add(device)
            copies = []
            for index in sorted(indices, key=lambda i: i not in staged):
                src = sources[index].detach()
                if index in staged:
                    assert self._pool is not None
                    copies.append(QueuedCopy(self._pool.buffer(index), src, True))
                else:
                    buf = buffers[index]
                    copies.append(QueuedCopy(buf.tensor, src, buf.pinned))
            self._ops.copy_all(device, copies, phase="stage")
            events[device] = self._ops.record(device)
        return events

    def _drain(
        self, staged: list[int], devices: dict[int, int], buffers: dict[int, _Buffer]
    ) -> dict[int, StagingEvent]:
        """Queue the copies from the device buffers to the host buffers (after the fenced ones, on the same
        stream); the writer waits for the returned events before reading."""
        assert self._pool is not None
        by_device: dict[int, list[int]] = {}
        for index in staged:
            by_device.setdefault(devices[index], []).append(index)
        events: dict[int, StagingEvent] = {}
        for device, indices in by_device.items():
            pool = self._pool
            copies = [QueuedCopy(buffers[i].tensor, pool.buffer(i), buffers[i].pinned) for i in indices]
            self._ops.copy_all(device, copies, phase="drain")
            events[device] = self._ops.record(device)
        return events

    def _device_buffers(self, sources: list[torch.Tensor], indices: list[int]) -> dict[int, _Buffer]:
        """Staging buffers for CUDA tensors: pinned within the cap, pageable beyond it or if pinning fails."""
        out: dict[int, _Buffer] = {}
        pageable = 0
        for index in indices:
            src = sources[index]
            slot = self._slot(index)
            if slot is None or not self._fits(slot, src):
                self._drop(index)  # its pinned bytes no longer count against the cap
                pinned = self._pin(src)
                if pinned is not None:
                    slot = self._put(index, pinned, pinned=True)
                else:
                    slot = self._put(index, self._host_empty(src), pinned=False)
            if not slot.pinned:
                pageable += tensor_bytes(src)
            out[index] = slot
        if pageable and self._pinned_limit > 0 and not self._warned:
            self._warned = True
            total = sum(tensor_bytes(sources[i]) for i in indices)
            why = (
                f"pinning host memory failed ({self._pin_error})"
                if self._pin_error is not None
                else f"CheckpointOptions.pinned_staging_bytes={format_bytes(self._pinned_limit)} is reached "
                f"({format_bytes(self._pinned_held)} held)"
            )
            logger.warning(
                "checkpoint staging: %s; %s of the %s of CUDA tensors are staged in pageable memory, whose "
                "device-to-host copies are synchronous and several times slower (save blocks for them)",
                why,
                format_bytes(pageable),
                format_bytes(total),
            )
        return out

    def _pin(self, src: torch.Tensor) -> torch.Tensor | None:
        """A pinned buffer for ``src`` if the cap allows it and pinning works, else None."""
        cost = _pinned_cost(tensor_bytes(src))
        if cost == 0 or self._pin_error is not None or self._pinned_held + cost > self._pinned_limit:
            return None
        try:
            tensor = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
            self.host_allocations += 1
        except RuntimeError as exc:  # torch.OutOfMemoryError is one; so is "no CUDA driver"
            self._pin_error = " ".join(str(exc).split())[:200]
            return None
        self._pinned_held += cost
        return tensor

    def _host_empty(self, src: torch.Tensor) -> torch.Tensor:
        self.host_allocations += 1
        return torch.empty(src.shape, dtype=src.dtype, device="cpu")

    # -- buffer slots ---------------------------------------------------------------------------------
    def _fits(self, slot: _Buffer, src: torch.Tensor) -> bool:
        return self._reuse and slot.tensor.shape == src.shape and slot.tensor.dtype == src.dtype

    def _slot(self, index: int) -> _Buffer | None:
        return self._buffers[index] if index < len(self._buffers) else None

    def _drop(self, index: int) -> None:
        old = self._slot(index)
        if old is not None:
            if old.pinned:
                self._pinned_held -= _pinned_cost(tensor_bytes(old.tensor))
            self._buffers[index] = None

    def _put(self, index: int, tensor: torch.Tensor, *, pinned: bool) -> _Buffer:
        self._drop(index)
        while len(self._buffers) <= index:
            self._buffers.append(None)
        slot = self._buffers[index] = _Buffer(tensor, pinned)
        return slot

    def _trim(self, count: int) -> None:
        for index in range(count, len(self._buffers)):
            self._drop(index)
        del self._buffers[count:]

    def release(self) -> None:
        """Drop every buffer (pinned ones go back to torch's host allocator cache, device ones to its device
        allocator's)."""
        self._trim(0)
        if self._pool is not None:
            self._pool.release()


def tensor_signature(state: Any) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """What the staging buffers of a save of ``state`` depend on: each distinct tensor's device, shape and
    dtype, in order (equal signatures: the same buffers fit)."""
    _, sources = _split(state, copy=False)
    return tuple((str(t.device), tuple(t.shape), t.dtype) for t in sources)


def _split(state: Any, *, copy: bool) -> tuple[Any, list[torch.Tensor]]:
    """``state``'s skeleton (tensors replaced by references) and the distinct tensors, in order.  With
    ``copy`` the other leaves are copied (so that later changes do not reach the snapshot)."""
    memo: dict[int, int] = {}
    sources: list[torch.Tensor] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _packable(obj):
            index = memo.get(id(obj))
            if index is None:
                index = len(sources)
                memo[id(obj)] = index
                sources.append(obj)
            return {TENSOR_REF_KEY: index}
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu", copy=True) if copy else obj
        return _copy_leaf(obj) if copy else obj

    return map_leaves(state, leaf), sources


def _copy_leaf(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return obj
    return copy.deepcopy(obj)


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().resolve_conj().resolve_neg()
