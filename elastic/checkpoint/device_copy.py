"""The copy streams and events staging uses, behind an interface of our own.

:class:`CopyOps` queues copies on one copy stream per device, records :class:`StagingEvent` s after them,
orders the caller's (training) stream after an event, and says which tensors live on a device.
:class:`CudaCopyOps` is CUDA's; :class:`HostCopyOps` is an in-memory one whose "devices" are CPU tensors and
whose copy stream is a worker thread (copies run in order, events complete as the worker passes them), with
hooks to hold a phase (``"stage"``: the copies the fence waits for; ``"drain"``: device buffers to host)
or to make its copies fail, so that CPU tests exercise the same staging code as a GPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import torch

__all__ = ["CopyOps", "CudaCopyOps", "HostCopyOps", "Phase", "QueuedCopy", "StagingCopyError", "StagingEvent"]

#: ``stage``: the copies a fence waits for (device-to-device, or direct device-to-host);
#: ``drain``: from the device buffers to the host buffers, after the fence.
Phase = Literal["stage", "drain"]


class QueuedCopy(NamedTuple):
    """``dst.copy_(src)``; ``non_blocking``: asynchronous (a pinned or device destination)."""

    dst: torch.Tensor
    src: torch.Tensor
    non_blocking: bool


class StagingCopyError(RuntimeError):
    """A queued staging copy failed (surfaces from :meth:`StagingEvent.wait`, as a failed save)."""


class StagingEvent(Protocol):
    """A point in one device's copy stream."""

    def wait(self) -> None:
        """Block the calling thread until the copies before this point are done; raise if one failed."""
        ...

    def query(self) -> bool:
        """Whether the copies before this point are done (without blocking)."""
        ...


class CopyOps(Protocol):
    def device_of(self, tensor: torch.Tensor) -> int | None:
        """The device index of ``tensor`` if it is staged through a copy stream, else None (host tensor)."""
        ...

    @property
    def needs_pinned_host(self) -> bool:
        """Whether copies into pageable host memory block the host (then only pinned buffers drain)."""
        ...

    def begin(self, device: int) -> None:
        """Order the copy stream after everything queued so far on the caller's current stream."""
        ...

    def copy_all(self, device: int, copies: Sequence[QueuedCopy], *, phase: Phase) -> None:
        """Queue ``copies`` in order on ``device``'s copy stream (one call per device and phase: a save of
        thousands of tensors pays the stream's set-up once, not per tensor)."""
        ...

    def record(self, device: int) -> StagingEvent:
        """An event after everything queued so far on ``device``'s copy stream."""
        ...

    def order_after(self, device: int, event: StagingEvent) -> None:
        """Order later work on the caller's current stream of ``device`` after ``event`` (the fence)."""
        ...


class _CudaEvent:
    def __init__(self, device: int, event: Any) -> None:
        self.device = device
        self.event = event

    def wait(self) -> None:
        with torch.cuda.device(self.device):  # this thread (the writer's) may not have used CUDA yet
            self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())


class CudaCopyOps:
    """One copy stream per device; ``non_blocking`` copies ordered after the current stream."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    @property
    def needs_pinned_host(self) -> bool:
        return True

    def device_of(self, tensor: torch.Tensor) -> int | None:
        if not tensor.is_cuda:
            return None
        index = tensor.device.index
        return torch.cuda.current_device() if index is None else index

    def _stream(self, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def begin(self, device: int) -> None:
        with torch.cuda.device(device):
            self._stream(device).wait_stream(torch.cuda.current_stream(device))

    def copy_all(self, device: int, copies: Sequence[QueuedCopy], *, phase: Phase) -> None:
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for dst, src, non_blocking in copies:
                if src.numel() == 0:
                    continue
                for t in (src, dst):  # a tensor freed meanwhile is not reused before the copy
                    if t.is_cuda:
                        t.record_stream(stream)
                if src.is_conj() or src.is_neg():  # copy_ would fix these bits on the host, too early
                    src = src.resolve_conj().resolve_neg()
                dst.copy_(src, non_blocking=non_blocking)  # pageable destination: blocks until copied

    def record(self, device: int) -> StagingEvent:
        with torch.cuda.device(device):
            event = torch.cuda.Event(blocking=True)  # the writer's synchronize() sleeps, it does not spin
            event.record(self._stream(device))
        return _CudaEvent(device, event)

    def order_after(self, device: int, event: StagingEvent) -> None:
        assert isinstance(event, _CudaEvent)
        torch.cuda.current_stream(device).wait_event(event.event)


class _HostEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise StagingCopyError(f"a staging copy failed: {self._error}") from self._error

    def query(self) -> bool:
        return self._done.is_set()


class HostCopyOps:
    """In-memory copy streams (see the module docstring).  ``on_device`` picks the "device" tensors (default:
    every tensor, on device 0).  ``hold(phase)`` keeps that phase's copies (and everything after them on the
    stream) from running until ``release(phase)``; ``fail(phase)`` makes that phase's copies raise.
    ``log`` records ``(phase, destination data_ptr)`` as copies run, and ``"wait"`` entries as host waits
    return.  ``needs_pinned_host``: behave like CUDA, whose drains need pinned host buffers."""

    def __init__(
        self, on_device: Callable[[torch.Tensor], int | None] | None = None, *, needs_pinned_host: bool = False
    ) -> None:
        self._on_device = on_device or (lambda _t: 0)
        self._needs_pinned_host = needs_pinned_host
        self._queues: dict[int, queue.SimpleQueue[Callable[[], None] | None]] = {}
        self._errors: dict[int, BaseException | None] = {}
        self._gates: dict[str, threading.Event] = {}
        self._failing: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.log: list[tuple[str, int]] = []

    @property
    def needs_pinned_host(self) -> bool:
        return self._needs_pinned_host

    def device_of(self, tensor: torch.Tensor) -> int | None:
        return self._on_device(tensor)

    def hold(self, phase: Phase) -> None:
        self._gates[phase] = threading.Event()

    def release(self, phase: Phase) -> None:
        gate = self._gates.pop(phase, None)
        if gate is not None:
            gate.set()

    def fail(self, phase: Phase) -> None:
        self._failing.add(phase)

    def _queue(self, device: int) -> queue.SimpleQueue[Callable[[], None] | None]:
        q = self._queues.get(device)
        if q is None:
            q = self._queues[device] = queue.SimpleQueue()
            self._errors[device] = None
            thread = threading.Thread(target=self._run, args=(q,), name=f"host-copy-stream-{device}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return q

    def _run(self, q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            op()

    def begin(self, device: int) -> None:
        self._queue(device)  # the host is the "current stream": everything before this call is done

    def copy_all(self, device: int, copies: Sequence[QueuedCopy], *, phase: Phase) -> None:
        for dst, src, _ in copies:
            self._copy(device, dst, src, phase)

    def _copy(self, device: int, dst: torch.Tensor, src: torch.Tensor, phase: Phase) -> None:
        gate = self._gates.get(phase)
        failing = phase in self._failing

        def op() -> None:
            if gate is not None:
                gate.wait()
            if self._errors[device] is not None:
                return  # a stream with a failed copy does nothing more (as a CUDA error is sticky)
            try:
                if failing:
                    raise RuntimeError(f"injected failure of a {phase} copy")
                dst.copy_(src)
                self.log.append((phase, dst.data_ptr()))
            except Exception as exc:
                self._errors[device] = exc

        self._queue(device).put(op)

    def record(self, device: int) -> StagingEvent:
        event = _HostEvent()
        self._queue(device).put(lambda: event._finish(self._errors[device]))
        return event

    def order_after(self, device: int, event: StagingEvent) -> None:
        # the host is the caller's stream here: later work starts once the event is done.  A failed copy
        # does not raise here (a CUDA stream's wait_event does not either): the save reports it
        try:
            event.wait()
        except StagingCopyError:
            pass
        self.log.append(("wait", 0))

    def close(self) -> None:
        for gate in list(self._gates.values()):
            gate.set()
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
