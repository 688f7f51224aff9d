"""Training progress reported by a job's workers to one etcd key that the job service reads.

The service's node agent sets the progress key and the etcd connection in each worker's environment
(:class:`elastic.contract.env.WorkerEnv`); :func:`create_reporter` builds a reporter from them. Outside the service
(plain torchrun, tests) the variables are absent and the reporter does nothing, so training code can
always call it.

Only rank 0 writes (one key per job, last value wins). ``report`` never waits for etcd: it leaves the report
in a one-value slot that a background thread writes, at most once per ``min_interval`` (whether or not the
previous write succeeded) unless the report is forced (a committed checkpoint); reports in between are
coalesced into the latest. While etcd is unreachable the latest report is retried; ``close`` waits a bounded
time for it. A failed write is logged: progress reporting never stops or slows training.

The wire format (:class:`~elastic.contract.progress.Progress`) and its checks are the contract's, shared
with the service that reads it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from elastic.contract.env import TorchrunEnv, WorkerEnv
from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, EtcdError, create_client

logger = logging.getLogger(__name__)

__all__ = ["EtcdProgressReporter", "NullProgressReporter", "ProgressReporter", "create_reporter"]


class ProgressReporter:
    """Publishes progress for the service. Contract: ``report`` never raises and never waits for etcd;
    ``close`` releases connections, waits a bounded time for the last report, and may be called twice."""

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        """``nodes``: the round's node names; remembered, like the checkpoint, for later reports."""
        raise NotImplementedError

    def close(self, timeout: timedelta | None = None) -> None:
        raise NotImplementedError


class NullProgressReporter(ProgressReporter):
    """Used outside the service: drops every report."""

    def report(self, step: int, *, world_size: int, **kwargs: Any) -> None:
        return None

    def close(self, timeout: timedelta | None = None) -> None:
        return None


class EtcdProgressReporter(ProgressReporter):
    """Writes :class:`Progress` JSON to ``key`` from a background thread; remembers the last committed
    checkpoint across reports.

    ``report`` only puts the report in a one-value slot (the newest replaces an unwritten older one) and
    returns: microseconds, whatever etcd does. The writer thread writes the slot at most once per
    ``min_interval``, counted from the start of the previous attempt whether it succeeded or not; a forced
    report (a committed checkpoint) is written without waiting for the interval. A failed write keeps the
    report in the slot unless a newer one came, so the latest report lands once etcd answers again.
    ``close`` writes what is left in the slot, waiting at most ``close_timeout`` (etcd down: the report is
    dropped with a warning).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        min_interval: timedelta = timedelta(seconds=1),
        generation: int | None = None,
        restart_count: int = 0,
        close_timeout: timedelta = timedelta(seconds=5),
    ) -> None:
        self._client = client
        self._key = key
        self._min_interval = min_interval.total_seconds()
        # after a failed write: wait at least this long before the next try (min_interval may be 0)
        self._retry_interval = max(self._min_interval, 0.2)
        self._close_timeout = close_timeout
        self._generation = generation
        self._restart_count = restart_count
        self._checkpoint: tuple[int | None, str | None] = (None, None)
        self._nodes: list[str] | None = None
        self._cond = threading.Condition(threading.Lock())
        # guarded by _cond:
        self._pending: Progress | None = None  # the latest report not written yet
        self._urgent = False  # the pending report was forced: no interval to wait
        self._next_write = 0.0  # time.monotonic() before which the interval holds the next write back
        self._closed = False  # close() was called: write what is pending, then stop
        self._abandoned = False  # close() stopped waiting: drop what is pending, close the client on exit
        self._done = False  # the writer thread left its loop
        # the writer thread's own:
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"progress-writer {key}", daemon=True)
        self._thread.start()

    def report(
        self,
        step: int,
        *,
        world_size: int,
        loss: float | None = None,
        total_steps: int | None = None,
        checkpoint_step: int | None = None,
        checkpoint_path: str | None = None,
        nodes: list[str] | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        try:
            if nodes is not None:
                self._nodes = sorted(nodes)
            if checkpoint_step is not None:
                self._checkpoint = (checkpoint_step, checkpoint_path)
                force = True
            progress = Progress(
                step=step,
                world_size=world_size,
                time=time.time(),
                total_steps=total_steps,
                loss=loss,
                generation=self._generation,
                restart_count=self._restart_count,
                checkpoint_step=self._checkpoint[0],
                checkpoint_path=self._checkpoint[1],
                nodes=self._nodes,
                extra=extra,
            )
            with self._cond:
                if self._closed:
                    return
                # wake the writer only when it may be idle (nothing pending) or must not wait (forced)
                wake = self._pending is None or (force and not self._urgent)
                self._pending = progress
                self._urgent = self._urgent or force
                if wake:
                    self._cond.notify()
        except Exception:  # the contract: reporting never breaks training
            logger.exception("progress report dropped")

    def close(self, timeout: timedelta | None = None) -> None:
        """Write the last report (waiting at most ``timeout``, default ``close_timeout``), then release
        the etcd client. A second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        limit = (timeout if timeout is not None else self._close_timeout).total_seconds()
        self._thread.join(limit)
        with self._cond:
            if not self._done:  # still writing (etcd unreachable): give up; the thread closes the client
                self._abandoned = True
                self._pending = None
                self._cond.notify()
                logger.warning("the last progress report was not written within %.1fs (etcd unreachable?)", limit)
                return
        self._client.close()

    # -- the writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                progress = self._next()
                if progress is None:
                    self._done = True
                    abandoned = self._abandoned
                    break
                self._next_write = time.monotonic() + self._min_interval  # whether the write succeeds or not
            written = self._write(progress)
            with self._cond:
                if not written:
                    self._next_write = time.monotonic() + self._retry_interval
                    if written is False and self._pending is None and not self._abandoned:
                        self._pending = progress  # retry it, unless a newer report came meanwhile
        if abandoned:
            self._client.close()

    def _next(self) -> Progress | None:
        """Wait (holding ``_cond``) for the next report to write; None: the reporter is closed and done."""
        while True:
            if self._abandoned:
                return None
            if self._pending is None:
                if self._closed:
                    return None
                self._cond.wait()
                continue
            wait = self._next_write - time.monotonic()
            failing = self._failing_since is not None
            if wait <= 0 or ((self._urgent or self._closed) and not failing):
                progress, self._pending, self._urgent = self._pending, None, False
                return progress
            self._cond.wait(wait)

    def _write(self, progress: Progress) -> bool | None:
        """True: written; False: etcd failed (retry); None: the report itself is unwritable (dropped)."""
        try:
            raw = progress.to_json()
            Progress.from_json(raw)  # what the controller would refuse is refused here, where it is made
        except (TypeError, ValueError) as exc:
            logger.warning("progress report dropped: %s", exc)
            return None
        try:
            self._client.put(self._key, raw)
        except EtcdError as exc:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                logger.warning("progress report not written, retrying with the latest report: %s", exc)
            else:
                logger.debug("progress report not written: %s", exc)
            return False
        except Exception:  # the writer thread must outlive any surprise
            logger.exception("progress report dropped")
            return None
        if self._failing_since is not None:
            logger.info("progress reports written again after %.1fs", time.monotonic() - self._failing_since)
            self._failing_since = None
        return True


def create_reporter(
    env: Mapping[str, str] | None = None, min_interval: timedelta = timedelta(seconds=1), rank: int | None = None
) -> ProgressReporter:
    """A reporter for this worker: writes only on rank 0 and only when the service configured a key.

    ``rank``: this worker's rank in the job (default ``$RANK``, which is node-local under live recovery,
    where the trainer passes the live group's rank)."""
    env = os.environ if env is None else env
    worker = WorkerEnv.from_environ(env)
    torchrun = TorchrunEnv.from_environ(env)
    rank = torchrun.rank if rank is None else rank
    if worker.job is None or worker.etcd is None or rank != 0:
        return NullProgressReporter()
    # short timeouts: they bound one write attempt of the writer thread (report() never waits for etcd)
    etcd = replace(worker.etcd, op_timeout=timedelta(seconds=5), request_timeout=timedelta(seconds=2))
    return EtcdProgressReporter(
        create_client(etcd.config()),
        worker.job.progress_key,
        min_interval=min_interval,
        generation=worker.job.generation,
        restart_count=torchrun.restart_count,
    )
