"""The metric series (service.core.series): bounded whatever the job's length, its shape kept when downsampled."""

from __future__ import annotations

import math

import pytest

from elastic.contract.progress import Progress
from service.core.series import (
    MetricPoint,
    MetricSeries,
    SeriesLimits,
    fit,
    merge_windows,
    point_from_progress,
    window_of,
)

pytestmark = pytest.mark.timeout(60)


def _loss(i: int) -> float:
    """A decaying curve with a spike every 7919 reports and a dip every 3001 (what a downsampler must keep)."""
    base = 5.0 * math.exp(-i / 20_000) + 0.01 * math.sin(i / 50)
    return base + (10.0 if i % 7919 == 0 else 0.0) - (1.0 if i % 3001 == 1500 else 0.0)


def _point(i: int) -> MetricPoint:
    return MetricPoint(
        t=1_000.0 + i,
        step=i,
        world_size=3 if i < 50_000 else 2,
        loss=_loss(i),
        steps_per_s=1.0 + (i % 10) / 10,
        restart_count=0 if i < 50_000 else 1,
    )


def test_series_of_100k_reports_stays_bounded_and_keeps_first_last_min_max_of_every_window() -> None:
    limits = SeriesLimits()
    series = MetricSeries(limits)
    n = 100_000
    most_points = (limits.full_chunks + 1) * limits.chunk_points
    for i in range(n):
        assert series.append(_point(i))
        assert len(series.points) <= most_points and len(series.windows) <= limits.max_windows
    assert series.count == n
    # every report is in exactly one window or point, in order, without gaps
    assert sum(w.n for w in series.windows) + len(series.points) == n
    assert series.windows[0].t_first == 1_000.0 and series.points[-1].t == 1_000.0 + n - 1
    covered = 0
    for w in series.windows:
        first, last = covered, covered + w.n - 1
        assert (w.t_first, w.t_last) == (1_000.0 + first, 1_000.0 + last)
        losses = [_loss(i) for i in range(first, last + 1)]
        assert w.loss == (losses[0], losses[-1], min(losses), max(losses))
        assert w.step == (first, last, first, last)
        covered += w.n
    assert [p.step for p in series.points] == list(range(covered, n))
    # the spikes and the overall extremes survive
    assert max(w.loss[3] for w in series.windows if w.loss) == pytest.approx(max(_loss(i) for i in range(covered)))
    assert series.windows[0].world_size[0] == 3.0 and series.points[-1].world_size == 2
    assert any(w.world_size == (3.0, 2.0, 2.0, 3.0) for w in series.windows)  # the window of the change shows it


def test_a_report_not_newer_than_the_last_does_not_enter_the_series() -> None:
    series = MetricSeries(SeriesLimits(chunk_points=2, full_chunks=1, window_points=2))
    assert series.append(_point(5))
    assert not series.append(_point(5)) and not series.append(_point(3))
    assert [p.step for p in series.points] == [5]


def test_merging_windows_keeps_first_last_min_max_exact() -> None:
    pts = [_point(i) for i in range(40)]
    a, b = window_of(pts[:15]), window_of(pts[15:])
    whole = window_of(pts)
    assert merge_windows(a, b) == whole


def test_fit_returns_at_most_max_points_entries_covering_every_report() -> None:
    series = MetricSeries(SeriesLimits(chunk_points=10, full_chunks=3, window_points=2, max_windows=16))
    for i in range(1_000):
        series.append(_point(i))
    for most in (2, 3, 10, 25, 1_000):
        ws, ps = fit(series.windows, series.points, most)
        assert len(ws) + len(ps) <= most
        assert sum(w.n for w in ws) + len(ps) == 1_000
        assert max(w.loss[3] for w in ws if w.loss) >= max(w.loss[3] for w in series.windows if w.loss)


def test_point_from_progress_derives_steps_per_second_within_a_generation_only() -> None:
    first = point_from_progress(Progress(step=10, world_size=2, time=100.0, generation=1, loss=1.5), None)
    assert first.steps_per_s is None and first.loss == 1.5
    second = point_from_progress(
        Progress(step=30, world_size=2, time=104.0, generation=1, extra={"snapshots_saved": 3}), first
    )
    assert second.steps_per_s == 5.0 and second.snapshots_saved == 3
    restarted = point_from_progress(Progress(step=40, world_size=1, time=110.0, generation=2), second)
    assert restarted.steps_per_s is None
