"""Reading one snapshot file in chunks, checking its size and digest, into a chosen destination.

:func:`read_file` is one task of a parallel read (see :class:`~elastic.checkpoint.parallel_io.IoPool`): it
reads the file chunk by chunk into buffers a *sink* hands out, hashes every chunk as it arrives and hands it
back to the sink.  Sinks:

- :class:`ScratchSink`: one reused scratch buffer, the bytes are dropped (verification only);
- :class:`HostSink`: a host buffer of the file's size (``readinto`` straight into it, no copy);
- :class:`HostTensorSink`: a pack's tensors in host memory, each an allocation of its own (large runs read
  straight into them, small ones through a scratch buffer);
- :class:`DeviceSink`: the same tensors in a CUDA device's memory, through two pinned host buffers used in
  turn; each filled chunk is copied asynchronously on the task's own CUDA stream into its tensors, and an
  event per pinned buffer keeps it from being refilled before its copies have finished, so reading the next
  chunk overlaps the copies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from elastic.checkpoint.api import CheckpointCorruptError
from elastic.checkpoint.digest import new_hasher
from elastic.checkpoint.layout import FileEntry
from elastic.checkpoint.parallel_io import check_stop
from elastic.checkpoint.segments import Extent
from elastic.checkpoint.storage import BinaryReader, CheckpointStorage

logger = logging.getLogger(__name__)

__all__ = ["DeviceSink", "HostSink", "HostTensorSink", "ScratchSink", "Sink", "read_file"]


class Sink(Protocol):
    """Where the bytes of one file go, chunk by chunk, in file order."""

    def buffer(self, offset: int, length: int) -> memoryview:
        """A writable view to read the file's next bytes, from ``offset``, into: ``length`` bytes, or fewer (at
        least one) where the sink wants the next read to end sooner (:class:`HostTensorSink`)."""

    def filled(self, offset: int, view: memoryview) -> None:
        """``view`` (the last buffer handed out) now holds verified-in-progress bytes from ``offset``."""

    def close(self) -> None:
        """Called once, also after a failure: every transfer started must have ended on return."""


class ScratchSink:
    """One scratch buffer of at most ``chunk_bytes``, reused for every chunk (the bytes are not kept)."""

    def __init__(self, size: int, chunk_bytes: int) -> None:
        self._view = memoryview(bytearray(min(size, chunk_bytes)))

    def buffer(self, offset: int, length: int) -> memoryview:
        return self._view[:length]

    def filled(self, offset: int, view: memoryview) -> None:
        pass

    def close(self) -> None:
        pass


class HostSink:
    """The file's bytes land in ``target`` (a writable view of exactly the file's size)."""

    def __init__(self, target: memoryview) -> None:
        self._target = target

    def buffer(self, offset: int, length: int) -> memoryview:
        return self._target[offset : offset + length]

    def filled(self, offset: int, view: memoryview) -> None:
        pass

    def close(self) -> None:
        pass


class _ExtentCursor:
    """Walks a file's extents (:func:`~elastic.checkpoint.segments.segment_extents`) in file order."""

    def __init__(self, extents: Sequence[Extent]) -> None:
        self._extents = list(extents)
        self._index = 0
        self._within = 0  # bytes of the current extent already passed

    def peek(self, length: int) -> Extent:
        """The next piece: at most ``length`` bytes of the current extent, from where the walk is."""
        if self._index >= len(self._extents):
            raise ValueError("read past the file's last extent")
        extent = self._extents[self._index]
        return Extent(extent.tensor, extent.offset + self._within, min(length, extent.length - self._within))

    def take(self, length: int) -> Iterator[tuple[int | None, int, int, int]]:
        """The pieces of the next ``length`` bytes as ``(tensor, offset in it, length, position among the bytes)``
        (plain tuples: a state of many small tensors has a piece per tensor); advances past them."""
        extents, index, within, done = self._extents, self._index, self._within, 0
        while done < length:
            if index >= len(extents):
                raise ValueError("read past the file's last extent")
            extent = extents[index]
            n = min(length - done, extent.length - within)
            yield extent.tensor, extent.offset + within, n, done
            done += n
            within += n
            if within == extent.length:
                index, within = index + 1, 0
            self._index, self._within = index, within


class HostTensorSink:
    """The file's bytes land in their tensors (``tensors``: :func:`~elastic.checkpoint.codec.allocate_tensors`'s
    flat uint8 CPU tensors; ``extents``: where the file's bytes go, in order).  A run of bytes of one tensor that
    is at least ``direct_bytes`` long is read straight into the tensor's memory; shorter runs (small tensors, the
    alignment padding between tensors) are read together into a scratch buffer and copied into place, so that a
    state of many small tensors is not read a few bytes per call; a whole read that falls in one tensor goes
    straight into it whatever its length."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | None],
        extents: Sequence[Extent],
        chunk_bytes: int,
        direct_bytes: int = 256 << 10,
    ) -> None:
        self._tensors = tensors
        self._cursor = _ExtentCursor(extents)
        self._direct = direct_bytes
        self._scratch = memoryview(bytearray(max(1, min(chunk_bytes, direct_bytes))))
        self._views: dict[int, memoryview] = {}

    def _view(self, index: int) -> memoryview:
        view = self._views.get(index)
        if view is None:
            tensor = self._tensors[index]
            assert tensor is not None, "an empty tensor has no extent"
            view = self._views[index] = tensor.numpy().data
        return view

    def buffer(self, offset: int, length: int) -> memoryview:
        piece = self._cursor.peek(length)
        if piece.tensor is not None and (piece.length >= self._direct or piece.length == length):
            return self._view(piece.tensor)[piece.offset : piece.offset + piece.length]
        return self._scratch[: min(length, len(self._scratch))]

    def filled(self, offset: int, view: memoryview) -> None:
        in_place = view.obj is not self._scratch.obj
        for tensor, start, length, at in self._cursor.take(len(view)):
            if tensor is not None and not in_place:
                self._view(tensor)[start : start + length] = view[at : at + length]

    def close(self) -> None:
        pass


class DeviceSink:
    """The file's bytes land in their tensors (``tensors``: :func:`~elastic.checkpoint.codec.allocate_tensors`'s
    flat uint8 tensors on ``device``, 0-dimensional ones on the CPU; ``extents``: where the file's bytes go, in
    order) through two pinned host buffers of ``chunk_bytes`` (freed blocks are reused by torch's caching host
    allocator): each filled chunk's pieces are copied asynchronously on this sink's own CUDA stream into their
    tensors (a CPU tensor's piece at once), and an event per pinned buffer keeps it from being refilled before
    its copies have finished, so reading the next chunk overlaps them.

    ``ready`` is recorded on the stream that allocated the device tensors; this sink's stream waits for it
    before its first copy.  ``close`` waits for every copy, so on return the bytes are in device memory.  The
    waits block the reading thread rather than spin a core (blocking-sync events).  Where pinned memory cannot be
    had, the buffers are pageable (a warning, once): each copy then returns once its bytes left the buffer.
    """

    _pinning_warned = False

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | None],
        extents: Sequence[Extent],
        device: torch.device,
        size: int,
        chunk_bytes: int,
        ready: torch.cuda.Event,
    ) -> None:
        self._tensors = tensors
        self._cursor = _ExtentCursor(extents)
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_event(ready)
        length = max(1, min(size, chunk_bytes))
        self._pinned = [self._host_buffer(length) for _ in range(2)]
        self._views = [p.numpy().data for p in self._pinned]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    @classmethod
    def _host_buffer(cls, length: int) -> torch.Tensor:
        try:
            return torch.empty(length, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # cudaHostAlloc refused (pinned memory limits, a container's locked-memory cap)
            if not cls._pinning_warned:
                cls._pinning_warned = True
                logger.warning(
                    "snapshot load: pinned host memory unavailable (%s); reading through pageable "
                    "buffers (slower copies to the device)",
                    exc,
                )
            return torch.empty(length, dtype=torch.uint8)

    def buffer(self, offset: int, length: int) -> memoryview:
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # the copies out of this pinned buffer have finished: it may be refilled
        return self._views[self._turn][:length]

    def filled(self, offset: int, view: memoryview) -> None:
        turn = self._turn
        chunk = self._pinned[turn]
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            for tensor, start, length, at in self._cursor.take(len(view)):
                if tensor is None:
                    continue  # alignment padding
                target = self._tensors[tensor]
                assert target is not None, "an empty tensor has no extent"
                target[start : start + length].copy_(chunk[at : at + length], non_blocking=target.is_cuda)
            event = torch.cuda.Event(blocking=True)
            event.record(self._stream)
        self._copied[turn] = event
        self._turn = 1 - turn

    def close(self) -> None:
        done = torch.cuda.Event(blocking=True)
        done.record(self._stream)
        done.synchronize()


def _fill(f: BinaryReader, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the number of bytes read."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def read_file(
    storage: CheckpointStorage,
    rel: str,
    entry: FileEntry,
    sink: Sink,
    chunk_bytes: int,
    stop: threading.Event,
    *,
    uncached: bool = False,
) -> None:
    """Read file ``rel`` (described by ``entry``) into ``sink``, checking its exact size and its digest (by
    the algorithm ``entry`` names).  ``uncached``: read from the medium, not this host's page cache (see
    :meth:`~elastic.checkpoint.storage.CheckpointStorage.open_read_uncached`).

    Raises :class:`CheckpointCorruptError` naming ``entry.path`` for a short, long or changed file;
    ``FileNotFoundError`` for a missing one; :class:`~elastic.checkpoint.parallel_io.StopRequested` once
    ``stop`` is set.
    """
    hasher = new_hasher(entry.algorithm)
    size = entry.size
    opened = storage.open_read_uncached(rel) if uncached else storage.open_read(rel)
    try:
        with opened as f:
            done = 0
            while done < size:
                check_stop(stop)
                target = sink.buffer(done, min(chunk_bytes, size - done))
                got = _fill(f, target)
                if got < len(target):
                    raise CheckpointCorruptError(f"{entry.path} ended after {done + got} of {size} bytes")
                hasher.update(target)
                sink.filled(done, target)
                done += got
            if f.read(1):
                raise CheckpointCorruptError(f"{entry.path} is longer than {size} bytes")
    finally:
        sink.close()
    if hasher.hexdigest() != entry.digest:
        raise CheckpointCorruptError(f"{entry.algorithm.value} mismatch in {entry.path}")
