"""A job's metric series: its progress reports kept over its whole life, within a fixed size (pure, no I/O).

The newest reports are kept at full resolution (:class:`MetricPoint`); older ones are folded into windows
(:class:`MetricWindow`) that keep, for each value, the first, last, min and max of the reports they cover, so
the shape of a curve (its trend, its spikes, its dips) survives any amount of downsampling. The full-resolution
part is cut into chunks of ``chunk_points`` reports by the global index of each report (report ``i`` is in
chunk ``i // chunk_points``); once more than ``full_chunks`` chunks are held, the oldest one is folded into
windows of ``window_points`` reports each, and once more than ``max_windows`` windows are held, neighbouring
windows are merged in pairs (which keeps first, last, min and max exact). So the series never holds more than
``full_chunks * chunk_points + chunk_points`` points and ``max_windows`` windows, whatever the job's length.

The etcd layout (a key per chunk, one for the windows: only the newest chunk is rewritten as reports arrive)
is ``service.core.metric_store``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from elastic.contract.progress import SNAPSHOTS_SAVED, Progress

__all__ = [
    "VALUES",
    "Agg",
    "MetricPoint",
    "MetricSeries",
    "MetricWindow",
    "SeriesLimits",
    "fit",
    "merge_windows",
    "point_from_progress",
    "window_of",
]

#: the values of a point that windows aggregate (``t`` is the time, always increasing)
VALUES = (
    "step",
    "loss",
    "steps_per_s",
    "world_size",
    "generation",
    "restart_count",
    "checkpoint_step",
    SNAPSHOTS_SAVED,
)

#: ``(first, last, min, max)`` of one value over a window's reports
Agg = tuple[float, float, float, float]


class MetricPoint(BaseModel):
    """One progress report as kept: ``t`` seconds since the epoch, ``steps_per_s`` since the report before
    (None at a job's first report, across a restart or a step going back)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t: float = Field(ge=0, allow_inf_nan=False)
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    loss: float | None = Field(default=None, allow_inf_nan=False)
    steps_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    generation: int | None = Field(default=None, ge=0)
    restart_count: int = Field(default=0, ge=0)
    checkpoint_step: int | None = Field(default=None, ge=0)
    snapshots_saved: int | None = Field(default=None, ge=0)


class MetricWindow(BaseModel):
    """``n`` consecutive reports from ``t_first`` to ``t_last``: each value's ``(first, last, min, max)`` over
    the reports that have it (None: none had it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t_first: float = Field(ge=0, allow_inf_nan=False)
    t_last: float = Field(ge=0, allow_inf_nan=False)
    n: int = Field(ge=1)
    step: Agg
    world_size: Agg
    restart_count: Agg
    loss: Agg | None = None
    steps_per_s: Agg | None = None
    generation: Agg | None = None
    checkpoint_step: Agg | None = None
    snapshots_saved: Agg | None = None


@dataclass(frozen=True)
class SeriesLimits:
    """How much of a series is kept: at most ``(full_chunks + 1) * chunk_points`` points at full resolution
    and ``max_windows`` windows (each of ``window_points`` reports or more)."""

    chunk_points: int = 60
    full_chunks: int = 10
    window_points: int = 10
    max_windows: int = 240

    def __post_init__(self) -> None:
        if self.chunk_points < 1 or self.full_chunks < 1 or self.window_points < 1 or self.max_windows < 2:
            raise ValueError(f"invalid series limits: {self}")


def point_from_progress(progress: Progress, before: MetricPoint | None) -> MetricPoint:
    """The point of a (valid) progress report; ``before``: the job's previous point, for its steps/s."""
    rate = None
    same_run = before is not None and (progress.generation, progress.restart_count) == (
        before.generation,
        before.restart_count,
    )
    if before is not None and same_run and progress.time > before.t and progress.step >= before.step:
        rate = (progress.step - before.step) / (progress.time - before.t)
    saved = progress.extra.get(SNAPSHOTS_SAVED)
    return MetricPoint(
        t=progress.time,
        step=progress.step,
        world_size=progress.world_size,
        loss=progress.loss,
        steps_per_s=rate if rate is not None and math.isfinite(rate) else None,
        generation=progress.generation,
        restart_count=progress.restart_count,
        checkpoint_step=progress.checkpoint_step,
        snapshots_saved=saved if type(saved) is int and saved >= 0 else None,
    )


def _agg(values: Iterable[float | None]) -> Agg | None:
    seen = [float(v) for v in values if v is not None]
    return (seen[0], seen[-1], min(seen), max(seen)) if seen else None


def _merge_agg(a: Agg | None, b: Agg | None) -> Agg | None:
    if a is None or b is None:
        return a if b is None else b
    return (a[0], b[1], min(a[2], b[2]), max(a[3], b[3]))


def window_of(points: Sequence[MetricPoint]) -> MetricWindow:
    """The window of consecutive ``points`` (at least one)."""
    if not points:
        raise ValueError("a window of no points")
    aggs = {name: _agg(getattr(p, name) for p in points) for name in VALUES}
    return MetricWindow.model_validate({"t_first": points[0].t, "t_last": points[-1].t, "n": len(points), **aggs})


def merge_windows(a: MetricWindow, b: MetricWindow) -> MetricWindow:
    """``a`` then ``b`` as one window: first of ``a``, last of ``b``, min and max of both (exact)."""
    aggs = {name: _merge_agg(getattr(a, name), getattr(b, name)) for name in VALUES}
    return MetricWindow.model_validate({"t_first": a.t_first, "t_last": b.t_last, "n": a.n + b.n, **aggs})


def _pairs(windows: Sequence[MetricWindow]) -> list[MetricWindow]:
    out = [merge_windows(windows[i], windows[i + 1]) for i in range(0, len(windows) - 1, 2)]
    if len(windows) % 2:
        out.append(windows[-1])
    return out


class MetricSeries:
    """A job's series: ``windows`` (oldest reports, downsampled) then ``points`` (the newest, as reported).
    ``first_index``: the global index of ``points[0]`` (the number of reports folded into windows)."""

    def __init__(
        self,
        limits: SeriesLimits | None = None,
        windows: Sequence[MetricWindow] = (),
        points: Sequence[MetricPoint] = (),
        first_index: int = 0,
    ) -> None:
        self.limits = limits or SeriesLimits()
        self.windows: list[MetricWindow] = list(windows)
        self.points: list[MetricPoint] = list(points)
        self.first_index = first_index

    @property
    def count(self) -> int:
        """Reports ever appended (the global index of the next one)."""
        return self.first_index + len(self.points)

    @property
    def last(self) -> MetricPoint | None:
        return self.points[-1] if self.points else None

    @property
    def last_time(self) -> float | None:
        if self.points:
            return self.points[-1].t
        return self.windows[-1].t_last if self.windows else None

    def chunk_of(self, index: int) -> int:
        return index // self.limits.chunk_points

    def append(self, point: MetricPoint) -> bool:
        """Add the newest report; False (nothing changes) unless it is newer than the last one kept."""
        last = self.last_time
        if last is not None and point.t <= last:
            return False
        self.points.append(point)
        lim = self.limits
        # full chunks beyond ``full_chunks`` (the open, newest chunk not counted): fold the oldest
        while self.chunk_of(self.count - 1) - self.chunk_of(self.first_index) > lim.full_chunks:
            size = lim.chunk_points - self.first_index % lim.chunk_points
            old, self.points = self.points[:size], self.points[size:]
            self.first_index += size
            self.windows += [window_of(old[i : i + lim.window_points]) for i in range(0, size, lim.window_points)]
            if len(self.windows) > lim.max_windows:
                self.windows = _pairs(self.windows)
        return True

    def since(self, t: float | None) -> tuple[list[MetricWindow], list[MetricPoint]]:
        """The windows and points after time ``t`` (a window that ends after it is included whole)."""
        if t is None:
            return list(self.windows), list(self.points)
        return [w for w in self.windows if w.t_last > t], [p for p in self.points if p.t > t]


def fit(
    windows: Sequence[MetricWindow], points: Sequence[MetricPoint], max_points: int
) -> tuple[list[MetricWindow], list[MetricPoint]]:
    """At most ``max_points`` entries (windows and points together, ``max_points`` >= 2): windows merged in
    pairs, then, if the points alone are too many, the points folded into windows too (newest last)."""
    if max_points < 2:
        raise ValueError("max_points must be at least 2")
    ws, ps = list(windows), list(points)
    while len(ws) + len(ps) > max_points and len(ws) > 1:
        ws = _pairs(ws)
    if len(ws) + len(ps) > max_points:
        room = max(1, max_points - len(ws))
        per = math.ceil(len(ps) / room)
        ws += [window_of(ps[i : i + per]) for i in range(0, len(ps), per)]
        ps = []
        while len(ws) > max_points:
            ws = _pairs(ws)
    return ws, ps
