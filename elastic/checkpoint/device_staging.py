"""Device-side staging: which CUDA tensors a save first copies into buffers on their own device.

A save's fence (what the next forward, and with ``overlap_with`` the optimizer's next step, waits for) then
waits only for a device-to-device copy (HBM bandwidth), and the copy from those device buffers to the pinned
host buffers (the *drain*) runs on the copy stream across the following steps; the writer waits for the drain
before reading.  The device buffers are kept and reused from save to save, like the host ones.

:func:`plan_device_staging` is the decision, pure: per device, the free memory beyond a margin is the budget,
and tensors are device-staged in index order while they fit (buffers already held for them cost nothing);
the rest are copied straight to the host as before (per tensor).  :class:`DeviceBufferPool` applies the plan
through a :class:`DeviceMemory` (CUDA's, or :class:`HostDeviceMemory`, an in-memory one that reports a chosen
free figure and allocates CPU tensors).  Free memory is what the driver reports free: memory torch's caching
allocator holds for the training's own peak is not counted, so the buffers never take it.

Several pools in one process (the durable manager's and the node-local tier's) each plan against that figure, and
a buffer torch's caching allocator carves from memory it already holds (the activations just freed at a step
boundary) does not lower it: the next forward then takes that memory back from the driver.  So a pool's budget
also leaves out what the *other* pools over the same :class:`DeviceMemory` object hold on the device (the
managers share :data:`CUDA_MEMORY`).  That is conservative where their buffers did lower the driver's figure,
never more than the margin allows where they did not.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from elastic.compat import cuda_memory_fraction

__all__ = [
    "CUDA_MEMORY",
    "CudaDeviceMemory",
    "DeviceBudget",
    "DeviceBufferPool",
    "DeviceMemory",
    "DevicePlan",
    "DeviceStagingSettings",
    "HostDeviceMemory",
    "StageRequest",
    "format_bytes",
    "plan_device_staging",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

_GIB = 1 << 30

# One plan (measure free memory, allocate) at a time in this process: two managers (the durable one and the
# node-local tier's) warming up at once must not both count the same free memory.  It also guards every pool's
# buffers (``_POOLS``), which another pool's plan sums.
_PLAN_LOCK = threading.Lock()
_POOLS: weakref.WeakSet[DeviceBufferPool] = weakref.WeakSet()  # the live pools of this process


@dataclass(frozen=True)
class DeviceStagingSettings:
    """``enabled``: stage CUDA tensors in device buffers when memory allows.  The buffers leave at least
    ``max(margin_bytes, margin_fraction * total device memory)`` of the device free."""

    enabled: bool = True
    margin_bytes: int = 2 * _GIB
    margin_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.margin_bytes < 0:
            raise ValueError(f"device staging margin_bytes must be >= 0, got {self.margin_bytes}")
        if not 0.0 <= self.margin_fraction < 1.0:
            raise ValueError(f"device staging margin_fraction must be in [0, 1), got {self.margin_fraction}")

    def margin(self, total: int) -> int:
        return max(self.margin_bytes, int(self.margin_fraction * total))


@dataclass(frozen=True)
class StageRequest:
    """One CUDA tensor of a save: its index in the flattened state, device, shape and dtype."""

    index: int
    device: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    @classmethod
    def of(cls, index: int, device: int, tensor: torch.Tensor) -> StageRequest:
        return cls(index, device, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class DeviceBudget:
    """One device's figures for a plan: free (driver), total, the margin kept, the bytes newly allocated
    (``needed``) and already held (``reused``) by the staged tensors, and the bytes left direct."""

    free: int
    total: int
    margin: int
    needed: int = 0
    reused: int = 0
    direct: int = 0

    @property
    def budget(self) -> int:
        return max(0, self.free - self.margin)


@dataclass(frozen=True)
class DevicePlan:
    """``staged``: indices copied device-to-device first; ``direct``: indices copied straight to the host
    (both in index order).  ``reason`` says why, in one line."""

    staged: tuple[int, ...] = ()
    direct: tuple[int, ...] = ()
    budgets: dict[int, DeviceBudget] = field(default_factory=dict)
    reason: str = ""

    @property
    def all_staged(self) -> bool:
        return not self.direct


def plan_device_staging(
    requests: Sequence[StageRequest],
    held: Iterable[int],
    memory: dict[int, tuple[int, int]],
    settings: DeviceStagingSettings,
) -> DevicePlan:
    """Decide per tensor: device-staged while the device's budget (free beyond the margin) allows, in index
    order; ``held``: indices whose device buffer (same device, shape, dtype) is already allocated (free of
    charge); ``memory``: per device, (free, total) bytes as the driver reports them."""
    ordered = sorted(requests, key=lambda r: r.index)
    if not settings.enabled:
        return DevicePlan(direct=tuple(r.index for r in ordered), reason="device staging is off (device_staging=False)")
    reusable = set(held)
    left: dict[int, int] = {}
    figures: dict[int, dict[str, int]] = {}
    for device in sorted({r.device for r in ordered}):
        free, total = memory[device]
        margin = settings.margin(total)
        left[device] = max(0, free - margin)
        figures[device] = {"free": free, "total": total, "margin": margin, "needed": 0, "reused": 0, "direct": 0}
    staged: list[int] = []
    direct: list[int] = []
    for request in ordered:
        fig = figures[request.device]
        if request.index in reusable:
            staged.append(request.index)
            fig["reused"] += request.nbytes
        elif request.nbytes <= left[request.device]:
            staged.append(request.index)
            left[request.device] -= request.nbytes
            fig["needed"] += request.nbytes
        else:
            direct.append(request.index)
            fig["direct"] += request.nbytes
    budgets = {d: DeviceBudget(**fig) for d, fig in figures.items()}
    return DevicePlan(tuple(staged), tuple(direct), budgets, _reason(budgets, len(staged), len(direct)))


def _reason(budgets: dict[int, DeviceBudget], staged: int, direct: int) -> str:
    parts = []
    for device, b in sorted(budgets.items()):
        parts.append(
            f"cuda:{device}: {format_bytes(b.free)} free of {format_bytes(b.total)}, margin {format_bytes(b.margin)}, "
            f"{format_bytes(b.needed + b.reused)} device-staged ({format_bytes(b.reused)} in buffers already held), "
            f"{format_bytes(b.direct)} direct"
        )
    head = (
        "all tensors fit"
        if not direct
        else "no tensor fits"
        if not staged
        else f"{staged} tensors fit, {direct} do not (device memory beyond the margin is short)"
    )
    return f"{head}; " + "; ".join(parts)


class DeviceMemory(Protocol):
    """Where device buffers come from: free/total figures and allocation."""

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of ``device``."""
        ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        """A new uninitialized buffer on ``device``; raises ``torch.OutOfMemoryError`` when out of memory."""
        ...


class CudaDeviceMemory:
    """CUDA's: the driver's free figure (``cudaMemGetInfo``), capped at what torch's caching allocator may still
    reserve under a per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``), and that
    allocator."""

    def mem_info(self, device: int) -> tuple[int, int]:
        free, total = (int(x) for x in torch.cuda.mem_get_info(device))
        fraction = cuda_memory_fraction(device)
        if fraction < 1.0:
            free = min(free, max(0, int(fraction * total) - int(torch.cuda.memory_reserved(device))))
        return free, total

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        with torch.cuda.device(device):
            return torch.empty(shape, dtype=dtype, device=f"cuda:{device}")


#: the process's CUDA memory, shared by every manager's pool (pools over one memory object count each other's buffers)
CUDA_MEMORY = CudaDeviceMemory()


class HostDeviceMemory:
    """An in-memory :class:`DeviceMemory`: each device reports ``free`` bytes (less what it has handed out)
    of ``total``, and buffers are CPU tensors.  ``allocations`` counts the buffers handed out.  ``obtainable``
    (default: ``free``): what allocations may take in all, less than the reported figure where another process or a
    memory fraction takes the rest; ``refusals`` counts the allocations refused."""

    def __init__(self, free: int, total: int | None = None, obtainable: int | None = None) -> None:
        self._free = free
        self._total = total if total is not None else free
        self.obtainable = obtainable
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        self.refusals = 0

    def set_free(self, free: int) -> None:
        self._free = free

    def mem_info(self, device: int) -> tuple[int, int]:
        with self._lock:
            return max(0, self._free - self._used.get(device, 0)), self._total

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        nbytes = StageRequest(0, device, shape, dtype).nbytes
        limit = self._free if self.obtainable is None else min(self._free, self.obtainable)
        with self._lock:
            if self._used.get(device, 0) + nbytes > limit:
                self.refusals += 1
                raise torch.OutOfMemoryError(f"fake device {device}: {nbytes} bytes do not fit")
            self._used[device] = self._used.get(device, 0) + nbytes
            self.allocations += 1
        return torch.empty(shape, dtype=dtype)


class DeviceBufferPool:
    """The device buffers of one stager, by flattened-state index, reused while device, shape and dtype are
    unchanged and re-planned when they change.  Not thread-safe: one save (or warm-up) at a time uses it."""

    def __init__(self, memory: DeviceMemory, settings: DeviceStagingSettings) -> None:
        self._memory = memory
        self._settings = settings
        self._buffers: dict[int, tuple[StageRequest, torch.Tensor]] = {}
        self._last_reason: str | None = None
        # per device, the free figure at which an allocation last failed: no new buffer there until more is free
        self._refused_at: dict[int, int] = {}
        with _PLAN_LOCK:
            _POOLS.add(self)

    @property
    def settings(self) -> DeviceStagingSettings:
        return self._settings

    @property
    def held_bytes(self) -> int:
        return sum(req.nbytes for req, _ in self._buffers.values())

    def _held_on(self, device: int) -> int:
        return sum(req.nbytes for req, _ in self._buffers.values() if req.device == device)

    def buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index][1]

    def ensure(self, requests: Sequence[StageRequest]) -> DevicePlan:
        """Plan ``requests`` and hold a device buffer for every staged one (a buffer whose allocation fails
        after all moves its tensor to the direct path).  Buffers of indices no longer staged are dropped."""
        wanted = {r.index: r for r in requests}
        if not self._settings.enabled:
            plan = plan_device_staging(requests, (), {}, self._settings)
            self._log(plan)
            return plan
        with _PLAN_LOCK:
            for index in [i for i, (req, _) in self._buffers.items() if wanted.get(i) != req]:
                del self._buffers[index]  # shape/dtype/device changed or no longer in the state: re-planned below
            plan = self._plan_and_allocate(requests, wanted)
        self._log(plan)
        return plan

    def _plan_and_allocate(self, requests: Sequence[StageRequest], wanted: dict[int, StageRequest]) -> DevicePlan:
        devices = sorted({r.device for r in requests})
        memory, held_back = {}, []
        for d in devices:
            free, total = self._memory.mem_info(d)  # less what the other pools hold: see the module docstring
            others = sum(p._held_on(d) for p in list(_POOLS) if p is not self and p._memory is self._memory)
            free = max(0, free - others)
            refused_at = self._refused_at.get(d)
            if refused_at is not None and free <= refused_at:
                # an allocation failed at this figure (it overstates what this process may take): every new one
                # would fail too, and each failure empties torch's cache (a device sync), so none is tried
                held_back.append(
                    f"cuda:{d}: no new buffer while no more than {format_bytes(refused_at)} is "
                    "reported free (an allocation failed there)"
                )
                free = 0
            else:
                self._refused_at.pop(d, None)
            memory[d] = (free, total)
        plan = plan_device_staging(requests, self._buffers.keys(), memory, self._settings)
        staged: list[int] = []
        failed: list[int] = []
        for index in plan.staged:
            req = wanted[index]
            if index not in self._buffers:
                if req.device in self._refused_at:  # failed earlier in this plan: the rest go direct
                    failed.append(index)
                    continue
                try:
                    self._buffers[index] = (req, self._memory.empty(req.shape, req.dtype, req.device))
                except torch.OutOfMemoryError:
                    self._refused_at[req.device] = memory[req.device][0]
                    failed.append(index)
                    continue
            staged.append(index)
        keep = set(staged)
        for index in [i for i in self._buffers if i not in keep]:
            del self._buffers[index]
        notes = [plan.reason, *held_back]
        if failed:
            notes.append(f"{len(failed)} tensor(s) direct after a device buffer allocation failed (out of memory)")
        if failed or held_back:
            direct = tuple(sorted(set(plan.direct) | set(failed)))
            plan = DevicePlan(tuple(staged), direct, plan.budgets, "; ".join(notes))
        return plan

    def _log(self, plan: DevicePlan) -> None:
        """One INFO line whenever the decision changes (the first save's included), DEBUG otherwise."""
        path = (
            "device-side (device-to-device copy, drained to host on the copy stream)"
            if plan.staged and not plan.direct
            else "mixed: device-side where it fits, direct device-to-host for the rest"
            if plan.staged
            else "direct device-to-host"
        )
        key = f"{path}|{len(plan.staged)}|{len(plan.direct)}"
        level = logging.INFO if key != self._last_reason else logging.DEBUG
        self._last_reason = key
        logger.log(level, "checkpoint staging of CUDA tensors: %s: %s", path, plan.reason)

    def release(self) -> None:
        with _PLAN_LOCK:
            self._buffers.clear()


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (a view counts its own elements, not its storage's)."""
    return t.numel() * t.element_size()


def format_bytes(nbytes: int) -> str:
    """``nbytes`` for a log line: ``1.5 GiB``, ``12.0 MiB``, ``3.0 KiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
