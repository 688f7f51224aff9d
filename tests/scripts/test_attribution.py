"""bench/_attribution.py: a snapshot's cost split between its own steps and the rest of the interval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _attribution import StepTrace, attribute

pytestmark = pytest.mark.timeout(10)


def test_a_stall_after_each_save_counts_near_and_a_slowdown_between_saves_counts_far() -> None:
    """Steps 22..121 (100 steps, a save after steps 40, 60, ...: every 20): 10 ms each, +30 ms on the step right
    after a save and +1 ms on every step 6..20 after it; the base run is 10 ms flat."""
    every, first = 20, 22
    durations = []
    for step in range(first, first + 100):
        offset = (step - 1) % every + 1
        durations.append(0.010 + (0.030 if offset == 1 else 0.001 if offset > 5 else 0.0))
    base = StepTrace(tuple([0.010] * 100), first, gc_s=0.01, main_cpu_s=1.0, process_cpu_s=1.2)
    trace = StepTrace(tuple(durations), first, gc_s=0.06, main_cpu_s=1.0, process_cpu_s=1.7)
    got = attribute(trace, base, every)
    assert got["snapshots"] == 5 and got["base_step_ms"] == pytest.approx(10)
    assert got["near_ms"] == pytest.approx(30) and got["far_ms"] == pytest.approx(15)
    assert got["loss_ms"] == pytest.approx(45)
    assert got["gc_ms"] == pytest.approx(10)  # (0.06 - 0.01) s over 5 snapshots
    assert got["background_cpu_ms"] == pytest.approx(100)  # other threads: 0.7 s against 0.2 s, over 5 snapshots


def test_a_run_like_its_base_loses_nothing_even_when_the_base_steps_are_skewed() -> None:
    """Base and trace alike: 90 steps of 10 ms and 10 of 20 ms (median 10 ms, mean 11 ms). Measured against the
    median, each of the 5 snapshots would have "lost" 20 ms that no snapshot cost."""
    durations = tuple([0.010] * 90 + [0.020] * 10)
    base = StepTrace(durations, 22, gc_s=0.0, main_cpu_s=1.0, process_cpu_s=1.0)
    got = attribute(base, base, 20)
    assert got["loss_ms"] == pytest.approx(0, abs=1e-9) and got["base_step_ms"] == pytest.approx(11)


def test_attribution_without_an_interval_or_steps_is_refused() -> None:
    t = StepTrace((0.01,), 2, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="needs a snapshot interval"):
        attribute(t, t, 0)
