"""A small pool of I/O threads for checkpoint files, running batches of tasks all-or-nothing.

Checkpoint I/O parallelizes well in threads: ``os.write``/``readinto``, socket sends, BLAKE3 and SHA-256 on
large buffers all release the GIL.  :meth:`IoPool.run_all` runs one batch (the files of a save, of a
verification, of a load) and returns when every task of it has ended: when one task fails the others are
told to stop (the ``stop`` event each task receives, checked between chunks), tasks not yet started are
skipped, and only once all have ended is the first failure raised.  No task of a batch outlives its
``run_all`` call, so a failed save never leaves a worker writing into a directory being deleted.

Why its own threads and not ``concurrent.futures``: a background save in flight at interpreter exit is
completed by the writer thread after ``concurrent.futures`` has begun its own shutdown, when every executor
refuses new work.  The workers are daemon threads, so a pool that is never closed cannot hold up the
interpreter's exit; outside ``run_all`` they only wait for work.  ``close()`` stops and joins them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["IoPool", "StopRequested", "io_thread_count"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The most threads chosen automatically: beyond that a local disk or one S3 endpoint gains little.
MAX_AUTO_THREADS = 8


def io_thread_count(configured: int | None) -> int:
    """Threads for checkpoint I/O: ``configured`` (``CheckpointOptions.io_threads``), else one per CPU up to
    :data:`MAX_AUTO_THREADS`."""
    if configured is not None:
        if configured < 1:
            raise ValueError(f"io_threads must be >= 1, got {configured}")
        return configured
    return max(1, min(MAX_AUTO_THREADS, os.cpu_count() or 1))


class StopRequested(Exception):
    """Raised by a task that saw its batch's ``stop`` event (another task failed); never leaves ``run_all``."""


def check_stop(stop: threading.Event) -> None:
    """Raise :class:`StopRequested` once ``stop`` is set (call between chunks)."""
    if stop.is_set():
        raise StopRequested


class _Batch(Generic[T]):
    """The tasks of one ``run_all`` call: results, the first error, and how many are still to end."""

    def __init__(self, count: int) -> None:
        self.cond = threading.Condition()
        self.remaining = count
        self.results: list[T | None] = [None] * count
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self, index: int, task: Callable[[threading.Event], T]) -> None:
        try:
            if not self.stop.is_set():
                self.results[index] = task(self.stop)
        except StopRequested:
            pass
        except BaseException as exc:  # handed to run_all's caller, whatever it is
            with self.cond:
                if self.error is None:
                    self.error = exc
            self.stop.set()
        finally:
            with self.cond:
                self.remaining -= 1
                self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            while self.remaining:
                self.cond.wait()


_Item = tuple[_Batch[Any], int, Callable[[threading.Event], Any]]


class IoPool:
    """Up to ``threads`` worker threads (started on first use) shared by every batch given to ``run_all``.

    Tasks must not call ``run_all`` of the same pool (a full pool would wait on itself).  Usable as a
    context manager (closed on exit); ``close`` is idempotent.
    """

    def __init__(self, threads: int, name: str = "checkpoint-io") -> None:
        if threads < 1:
            raise ValueError(f"an IoPool needs at least one thread, got {threads}")
        self._threads = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def threads(self) -> int:
        return self._threads

    def _ensure_workers(self, wanted: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} pool is closed")
            while len(self._workers) < min(wanted, self._threads):
                worker = threading.Thread(target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True)
                worker.start()
                self._workers.append(worker)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            batch, index, task = item
            batch.run(index, task)

    def run_all(self, tasks: Sequence[Callable[[threading.Event], T]]) -> list[T]:
        """Run ``tasks`` (each called with the batch's ``stop`` event) on the pool; their results in order.

        Returns when every task has ended.  The first failure stops the rest (see the module) and is then
        raised as it is; an interruption of the caller (``KeyboardInterrupt``) does the same.
        """
        if not tasks:
            return []
        self._ensure_workers(len(tasks))
        batch: _Batch[T] = _Batch(len(tasks))
        for index, task in enumerate(tasks):
            self._queue.put((batch, index, task))
        try:
            batch.wait()
        except BaseException:
            batch.stop.set()
            batch.wait()
            raise
        if batch.error is not None:
            raise batch.error
        return batch.results  # type: ignore[return-value]  # every task ended without error: all set

    def close(self) -> None:
        """Stop and join the workers (after the tasks already queued); later ``run_all`` calls raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)
        for worker in workers:
            worker.join()

    def __enter__(self) -> IoPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
