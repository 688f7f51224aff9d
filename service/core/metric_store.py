"""Each job's metric series in etcd (the series itself: :mod:`service.core.series`, pure).

Layout under ``<prefix>/metrics/<job id>/``::

    points/<chunk, 12 digits>   JSON list of MetricPoint: reports chunk*C .. chunk*C+C-1 at full resolution
    windows                     JSON {"first_index": n, "windows": [MetricWindow, ...]}: reports 0 .. n-1

The leader (:class:`MetricsRecorder`) appends each new progress report it sees to the job's series in memory
and writes what changed at most once per ``flush_every`` (one transaction per job, fenced by its leadership):
the open chunk of the newest points (at most C points), and, only when a chunk was folded into windows
(every C reports), the ``windows`` key and the deletion of the folded chunk. So a report costs one rewrite of
a value of at most C points, batched, and ``windows`` is rewritten once per C reports, never per report.
With the default limits (C = 60 points per chunk, 10 full chunks kept plus the open one, 240 windows) a job
holds at most 660 points and 240 windows: at most about 240 KB in etcd (bound checked, 260 KB: ``tests/service/core/
test_metric_store.py``), whatever its length. The series is deleted with the job (the leader's purge).

Anything may be stored under the prefix, so reading a series validates every value: an unreadable chunk or
windows record is skipped with a warning naming the job, never an error of the reader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient, EtcdConnectionError, EtcdError
from service.core.keys import Keys
from service.core.series import MetricPoint, MetricSeries, MetricWindow, SeriesLimits, point_from_progress
from service.core.view import ClusterView

logger = logging.getLogger(__name__)

__all__ = ["MetricsRecorder", "StoredWindows", "read_series"]

_POINTS = TypeAdapter(list[MetricPoint])


class StoredWindows(BaseModel):
    """The ``windows`` key: the series' downsampled past, reports ``0 .. first_index - 1``."""

    model_config = ConfigDict(extra="forbid")

    first_index: int = Field(ge=0)
    windows: list[MetricWindow]


def read_series(client: EtcdClient, keys: Keys, job_id: str, limits: SeriesLimits | None = None) -> MetricSeries:
    """The job's series as stored (empty when none is); unreadable values are skipped with a warning."""
    limits = limits or SeriesLimits()
    prefix = keys.metrics_of(job_id)
    kvs, _ = client.get_prefix(prefix)
    stored = StoredWindows(first_index=0, windows=[])
    chunks: list[tuple[int, list[MetricPoint]]] = []
    for kv in kvs:
        name = kv.key[len(prefix) :]
        try:
            if name == "windows":
                stored = StoredWindows.model_validate_json(kv.value)
            elif name.startswith("points/") and name[7:].isascii() and name[7:].isdigit():
                chunks.append((int(name[7:]), _POINTS.validate_json(kv.value)))
        except ValidationError as exc:
            logger.warning(
                "job %s: ignoring its unreadable metric series value at %s: %s", job_id, kv.key, exc.errors()[:1]
            )
    points: list[MetricPoint] = []
    for chunk, pts in sorted(chunks, key=lambda c: c[0]):
        for i, p in enumerate(pts):
            if chunk * limits.chunk_points + i < stored.first_index:
                continue  # folded into windows already (a fold written, its chunk's deletion not seen yet)
            if points and p.t <= points[-1].t:
                logger.warning("job %s: ignoring a stored metric point out of time order (chunk %d)", job_id, chunk)
                continue
            points.append(p)
    return MetricSeries(limits, stored.windows, points, stored.first_index)


@dataclass
class _Pending:
    chunks: set[int] = field(default_factory=set)  # chunks to (re)write
    folded: set[int] = field(default_factory=set)  # chunks to delete (folded into windows)
    windows: bool = False  # the windows key to rewrite


class MetricsRecorder:
    """The leader's side: appends the jobs' new progress reports to their series and writes them, batched.

    Not thread-safe: the reconcile loop's thread only. ``observe`` and ``flush`` never raise for one job's
    data (a bad value is that job's problem alone, logged)."""

    def __init__(
        self,
        client: EtcdClient,
        keys: Keys,
        limits: SeriesLimits | None = None,
        flush_every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.keys = keys
        self.limits = limits or SeriesLimits()
        self.flush_every = flush_every
        self._clock = clock
        self._series: dict[str, MetricSeries] = {}
        self._pending: dict[str, _Pending] = {}
        self._flushed_at: float | None = None
        # finished jobs are not held in memory once written: the time of the last report each one was seen with
        self._settled: dict[str, float] = {}

    def reset(self) -> None:
        """Forget everything (leadership lost): the next leader reads the series back from etcd."""
        self._series.clear()
        self._pending.clear()
        self._settled.clear()
        self._flushed_at = None

    def forget(self, job_ids: Iterable[str]) -> None:
        """Jobs deleted: nothing more of theirs is written."""
        for job_id in job_ids:
            self._series.pop(job_id, None)
            self._pending.pop(job_id, None)
            self._settled.pop(job_id, None)

    def series(self, job_id: str) -> MetricSeries | None:
        return self._series.get(job_id)

    def observe(self, view: ClusterView) -> int:
        """Append each job's progress report newer than its series' last point; returns how many were."""
        added = 0
        for job_id in [j for j in [*self._series, *self._settled] if j not in view.jobs]:  # deleted jobs
            self.forget([job_id])
        for job_id, progress in view.progress.items():
            entry = view.jobs.get(job_id)
            if entry is None:
                continue
            settled = self._settled.get(job_id)
            if settled is not None and progress.time <= settled:
                continue  # a finished job's last report, already in its series (and out of memory)
            try:
                series = self._series.get(job_id)
                if series is None:
                    series = self._series[job_id] = read_series(self.client, self.keys, job_id, self.limits)
                added += self._append(job_id, series, progress)
                if entry.status.state.terminal:  # its last report: held until written, then let go
                    self._settled[job_id] = max(series.last_time or 0.0, progress.time)
                    if job_id not in self._pending:
                        del self._series[job_id]
            except EtcdConnectionError:
                raise
            except (EtcdError, ValueError) as exc:  # a value the series refuses: this job's alone
                logger.warning(
                    "job %s: its progress report was not added to its metric series: %s", job_id, str(exc)[:300]
                )
        return added

    def _append(self, job_id: str, series: MetricSeries, progress: Progress) -> bool:
        last = series.last_time
        if last is not None and progress.time <= last:
            return False
        before_first, before_windows = series.first_index, len(series.windows)
        if not series.append(point_from_progress(progress, series.last)):
            return False
        pending = self._pending.setdefault(job_id, _Pending())
        pending.chunks.add(series.chunk_of(series.count - 1))
        if series.first_index != before_first or len(series.windows) != before_windows:
            pending.windows = True
            for chunk in range(series.chunk_of(before_first), series.chunk_of(series.first_index)):
                pending.folded.add(chunk)
                pending.chunks.discard(chunk)
        return True

    def flush(self, fence: tuple[str, int] | None, force: bool = False) -> int:
        """Write what changed, if ``flush_every`` passed since the last write (or ``force``): one transaction
        per job, guarded by ``fence`` (the leader key). Returns the number of jobs written."""
        now = self._clock()
        if not self._pending or (
            not force and self._flushed_at is not None and now - self._flushed_at < self.flush_every
        ):
            return 0
        self._flushed_at = now
        written = 0
        for job_id, pending in list(self._pending.items()):
            series = self._series.get(job_id)
            if series is None:
                del self._pending[job_id]
                continue
            puts = [(self.keys.metrics_chunk(job_id, c), self._chunk_value(series, c)) for c in sorted(pending.chunks)]
            if pending.windows:
                stored = StoredWindows(first_index=series.first_index, windows=series.windows)
                puts.append((self.keys.metrics_windows(job_id), stored.model_dump_json(exclude_none=True).encode()))
            deletes = [self.keys.metrics_chunk(job_id, c) for c in sorted(pending.folded)]
            try:
                ok, _ = self.client.commit(puts, deletes, guard=fence)
            except EtcdConnectionError:
                logger.warning("job %s: its metric series could not be written (etcd unreachable); retrying", job_id)
                return written
            except EtcdError as exc:
                logger.warning("job %s: etcd refused its metric series: %s", job_id, str(exc)[:300])
                del self._pending[job_id]
                self._series.pop(job_id, None)  # read back what is stored next time
                continue
            del self._pending[job_id]
            if not ok:  # leadership lost: another leader writes from now on
                self.reset()
                return written
            if job_id in self._settled:  # a finished job: nothing more will be appended
                self._series.pop(job_id, None)
            written += 1
        return written

    def _chunk_value(self, series: MetricSeries, chunk: int) -> bytes:
        size = series.limits.chunk_points
        lo = max(chunk * size, series.first_index) - series.first_index
        hi = (chunk + 1) * size - series.first_index
        return _POINTS.dump_json(series.points[lo:hi], exclude_none=True)
