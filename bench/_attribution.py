"""Where a snapshot's cost to the loop goes: the per-step times of a run with snapshots every ``every`` steps set
against the same loop without snapshots (issue 29, part 3). Pure arithmetic over what ``_overhead_worker.py``
records; ``loop_overhead_bench.py`` prints it.

The save is taken at the boundary after step ``k * every``; the ``near`` steps after it (offsets 1..``near``) hold
the save call, the fence (the next optimizer step waits for the copy of the state) and the stall of the steps the
copy overlaps. The other steps of the interval hold what runs beside training: the drain to host memory on the
copy engine, the writer's and hasher's threads (CPU, memory bandwidth, the GIL), the allocator. GC pauses and the
background threads' CPU are measured directly. With ``when_writer_busy="defer"`` a save that falls due while the
previous one is written moves to a later boundary: its near steps then count as far ones (the figures say so
only through a larger "far" share).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["NEAR_STEPS", "StepTrace", "attribute"]

NEAR_STEPS = 5  # the save's step and the 4 after it (the checkpoint bench's STALL_STEPS)


@dataclass(frozen=True)
class StepTrace:
    """One run's steady-state steps: ``durations[i]`` is step ``first_step + i``'s wall time (seconds); GC pauses,
    the main thread's and the whole process's CPU seconds over the same steps."""

    durations: tuple[float, ...]
    first_step: int
    gc_s: float
    main_cpu_s: float
    process_cpu_s: float

    @classmethod
    def from_json(cls, got: Mapping[str, Any]) -> StepTrace:
        return cls(
            tuple(got["step_seconds"]),
            int(got["first_step"]),
            float(got["gc_s"]),
            float(got["main_cpu_s"]),
            float(got["process_cpu_s"]),
        )

    def per_step(self, value: float) -> float:
        return value / len(self.durations)


def attribute(trace: StepTrace, base: StepTrace, every: int, near: int = NEAR_STEPS) -> dict[str, float]:
    """Milliseconds per snapshot: ``loss`` (all steps' excess over ``base``'s mean step: so that it is exactly
    the difference of the two runs' rates, a skewed base contributing nothing), split into ``near``
    (the save's steps) and ``far`` (the rest of the interval); ``gc`` (GC pauses beyond ``base``'s rate) and
    ``background_cpu`` (CPU of threads other than the main one, beyond ``base``'s rate)."""
    if every <= 0 or not trace.durations or not base.durations:
        raise ValueError("attribution needs a snapshot interval and steps in both runs")
    b = statistics.fmean(base.durations)
    near_s = far_s = 0.0
    for i, d in enumerate(trace.durations):
        offset = (trace.first_step + i - 1) % every + 1  # 1 for the step right after a save
        if offset <= near:
            near_s += d - b
        else:
            far_s += d - b
    snapshots = len(trace.durations) / every
    n = len(trace.durations)
    background = (trace.process_cpu_s - trace.main_cpu_s) - base.per_step(base.process_cpu_s - base.main_cpu_s) * n
    return {
        "snapshots": snapshots,
        "base_step_ms": 1000 * b,
        "loss_ms": 1000 * (near_s + far_s) / snapshots,
        "near_ms": 1000 * near_s / snapshots,
        "far_ms": 1000 * far_s / snapshots,
        "gc_ms": 1000 * (trace.gc_s - base.per_step(base.gc_s) * n) / snapshots,
        "background_cpu_ms": 1000 * background / snapshots,
    }
