"""Digests of the files DCP writes, taken from the bytes as they are written (sharded snapshots).

A sharded snapshot's files are written by ``torch.distributed.checkpoint``'s storage writer, not by us.  Its
manifest needs each file's size and digest; reading every file back to hash it costs a second pass over all
the bytes (the page cache's copy on a local file system, a download from an object store), on every rank, in
the background save.  Instead :func:`hash_while_writing` puts a file system of ours in front of the writer's
(DCP's ``FileSystemWriter`` and ``FsspecWriter`` open every file through ``self.fs.create_stream``): each file
opened ``"wb"`` is hashed as its bytes pass, and :class:`WriteDigests` keeps the size and digest of every file
written from its first byte to its last in order.  A file written any other way (a seek, a short or odd write,
a truncate, an error) is not recorded, and the caller reads it back as before; so is a file of a writer
without ``fs.create_stream`` (a torch whose DCP changed shape: :func:`hash_while_writing` returns False).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from elastic.checkpoint.digest import DigestAlgorithm, Hasher, new_hasher

__all__ = ["WriteDigests", "WrittenFile", "hash_while_writing"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WrittenFile:
    """A file written start to end in order: its size and its digest (of ``WriteDigests.algorithm``)."""

    size: int
    digest: str


def _name(path: Any) -> str:
    """The last component of a local path or URL: DCP names each file of an attempt uniquely."""
    return str(path).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


class _HashingStream:
    """A write stream that hashes what passes; anything but in-order writes spoils its record."""

    def __init__(self, inner: Any, hasher: Hasher) -> None:
        self._inner = inner
        self._hasher = hasher
        self.size = 0
        self.clean = True

    def write(self, data: Any) -> Any:
        written = self._inner.write(data)
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError):  # not a contiguous bytes-like object: cannot be hashed here
            self.clean = False
            return written
        if not isinstance(written, int) or written != view.nbytes:
            self.clean = False  # a short write: the caller writes the rest, and the record would be wrong
        if self.clean:
            self._hasher.update(view)
            self.size += view.nbytes
        return written

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    def writelines(self, lines: Iterable[Any]) -> None:
        for line in lines:
            self.write(line)

    def seek(self, offset: int, whence: int = 0) -> int:
        position = int(self._inner.seek(offset, whence))
        if position != self.size:
            self.clean = False
        return position

    def truncate(self, size: int | None = None) -> int:
        self.clean = False
        return int(self._inner.truncate(size))

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, writable, ...
        return getattr(self._inner, name)

    def __enter__(self) -> _HashingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


class WriteDigests:
    """File name -> :class:`WrittenFile` of the files hashed while written (thread-safe: DCP writes files on
    several threads)."""

    def __init__(self, algorithm: DigestAlgorithm) -> None:
        self.algorithm = algorithm
        self._lock = threading.Lock()
        self._files: dict[str, WrittenFile] = {}
        self._spoiled: set[str] = set()

    def stream(self, inner: Any) -> _HashingStream:
        return _HashingStream(inner, new_hasher(self.algorithm))

    def finish(self, path: Any, stream: _HashingStream) -> None:
        """The writer is done with ``path`` (its stream's context ended without an error)."""
        name = _name(path)
        with self._lock:
            if not stream.clean or name in self._files or name in self._spoiled:
                self._files.pop(name, None)  # written twice in one attempt: neither record is the file
                self._spoiled.add(name)
                return
            self._files[name] = WrittenFile(stream.size, stream.hexdigest())

    def spoil(self, path: Any) -> None:
        with self._lock:
            self._files.pop(_name(path), None)
            self._spoiled.add(_name(path))

    def get(self, name: str) -> WrittenFile | None:
        with self._lock:
            return self._files.get(name)


class _HashingFileSystem:
    """DCP's file system object with ``create_stream(path, "wb")`` hashed; everything else passes through."""

    def __init__(self, inner: Any, digests: WriteDigests) -> None:
        self._inner = inner
        self._digests = digests

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self._inner.create_stream(path, mode) as stream:
                hashing = self._digests.stream(stream)
                yield hashing
        except BaseException:
            self._digests.spoil(path)
            raise
        self._digests.finish(path, hashing)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hash_while_writing(writer: Any, digests: WriteDigests) -> bool:
    """Make DCP's storage ``writer`` hash the files it writes into ``digests``; False (nothing changed) when the
    writer has no ``fs.create_stream`` to do it through."""
    fs = getattr(writer, "fs", None)
    if fs is None or not callable(getattr(fs, "create_stream", None)):
        logger.warning(
            "DCP writer %s has no fs.create_stream: sharded files are read back to be hashed", type(writer).__name__
        )
        return False
    writer.fs = _HashingFileSystem(fs, digests)
    return True
