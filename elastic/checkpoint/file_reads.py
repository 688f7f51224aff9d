"""Reading one snapshot file in chunks, checking its size and digest, into a chosen destination.

:func:`read_file` is one task of a parallel read (see :class:`~elastic.checkpoint.parallel_io.IoPool`): it
reads the file chunk by chunk into buffers a *sink* hands out, hashes every chunk as it arrives and hands it
back to the sink.  Sinks:

- :class:`ScratchSink`: one reused scratch buffer, the bytes are dropped (verification only);
- :class:`HostSink`: the file's slice of a host buffer (``readinto`` straight into it, no copy);
- :class:`DeviceSink`: two pinned host buffers used in turn; each filled chunk is copied asynchronously on the
  task's own CUDA stream into the file's slice of a device buffer, and an event per pinned buffer keeps it
  from being refilled before its copy has finished, so reading the next chunk overlaps the copy.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from elastic.checkpoint.api import CheckpointCorruptError
from elastic.checkpoint.digest import new_hasher
from elastic.checkpoint.layout import FileEntry
from elastic.checkpoint.parallel_io import check_stop
from elastic.checkpoint.storage import BinaryReader, CheckpointStorage

__all__ = ["DeviceSink", "HostSink", "ScratchSink", "Sink", "read_file"]


class Sink(Protocol):
    """Where the bytes of one file go, chunk by chunk, in file order."""

    def buffer(self, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes to read the file's bytes ``[offset, offset + length)`` into."""

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


class DeviceSink:
    """The file's bytes land in ``device_buffer[base : base + size]`` (a 1-D uint8 CUDA tensor) through two
    pinned host buffers of ``chunk_bytes`` (freed blocks are reused by torch's caching host allocator).

    ``ready`` is recorded on the stream that allocated ``device_buffer``; this sink's stream waits for it
    before its first copy.  ``close`` waits for every copy, so on return the bytes are in device memory.
    """

    def __init__(
        self, device_buffer: torch.Tensor, base: int, size: int, chunk_bytes: int, ready: torch.cuda.Event
    ) -> None:
        self._device = device_buffer
        self._base = base
        self._stream = torch.cuda.Stream(device=device_buffer.device)
        self._stream.wait_event(ready)
        length = max(1, min(size, chunk_bytes))
        self._pinned = [torch.empty(length, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._views = [p.numpy().data for p in self._pinned]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def buffer(self, offset: int, length: int) -> memoryview:
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # the copy out of this pinned buffer has finished: it may be refilled
        return self._views[self._turn][:length]

    def filled(self, offset: int, view: memoryview) -> None:
        turn = self._turn
        length = len(view)
        start = self._base + offset
        with torch.cuda.device(self._device.device), torch.cuda.stream(self._stream):
            self._device[start : start + length].copy_(self._pinned[turn][:length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copied[turn] = event
        self._turn = 1 - turn

    def close(self) -> None:
        self._stream.synchronize()


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
