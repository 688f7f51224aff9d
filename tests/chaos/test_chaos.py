"""Short form of the chaos suite (CI): one job on the real service through every fault kind once.

The long form is ``python -m tests.chaos.runner --faults 50 --seed 1`` (see docs/benchmarks.md).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from tests.chaos.runner import ChaosConfig, FaultKind, run_chaos


@pytest.mark.timeout(480)
def test_job_completes_exactly_once_with_identical_replicas_through_one_fault_of_each_kind(tmp_path: Path) -> None:
    config = ChaosConfig(faults=len(FaultKind), seed=0, time_limit=timedelta(seconds=420), steps_between=8)
    report = run_chaos(config, tmp_path)
    print(report.summary())
    assert report.passed, report.summary()
    assert sorted(f.kind for f in report.faults) == sorted(k.value for k in FaultKind)
    assert report.resume_points_verified >= 1
