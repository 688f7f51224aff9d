"""bench/_disk.py and loop_overhead_bench's ``--save-every``: the snapshot interval the disk absorbs (issue 29's loop
goal holds where ``state / (interval x step) <= 0.8 x dd``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _disk import ABSORB_FRACTION, absorbed_interval, absorbs, dd_write_bytes_per_s
from loop_overhead_bench import ABSORBED, parse_intervals

pytestmark = pytest.mark.timeout(30)
GiB, MiB = 2**30, 2**20


def test_the_absorbed_interval_is_the_shortest_multiple_of_ten_whose_writes_fit_in_080_of_dd() -> None:
    # 1.5 GiB at an 18 ms step onto a 1,100 MiB/s disk: 1.5 GiB / (0.8 x 1,100 MiB/s x 18 ms) = 96.97 steps
    every = absorbed_interval(int(1.5 * GiB), 0.018, 1100 * MiB)
    assert every == 100
    assert absorbs(int(1.5 * GiB), 100, 0.018, 1100 * MiB) and not absorbs(int(1.5 * GiB), 90, 0.018, 1100 * MiB)
    assert not absorbs(int(1.5 * GiB), 50, 0.018, 1100 * MiB), "every 50 writes 1.7 GiB/s: more than the disk"


def test_exactly_at_the_limit_counts_as_absorbed_and_a_tiny_state_gets_the_shortest_interval() -> None:
    # 80 MiB per 10 steps of 0.1 s = 80 MiB/s = 0.8 x 100 MiB/s: on the limit
    assert absorbed_interval(80 * MiB, 0.1, 100 * MiB) == 10
    assert absorbs(80 * MiB, 10, 0.1, 100 * MiB) and not absorbs(80 * MiB + 1, 10, 0.1, 100 * MiB)
    assert absorbed_interval(1, 0.01, 100 * MiB) == 10
    assert absorbed_interval(0, 0.01, 100 * MiB, multiple=5) == 5
    assert ABSORB_FRACTION == 0.8
    assert absorbs(10 * GiB, 0, 0.01, 1.0), "no snapshots: nothing to absorb"


@pytest.mark.parametrize("bad", [{"step_s": 0.0}, {"disk_bytes_per_s": 0.0}, {"state_bytes": -1}, {"multiple": 0}])
def test_a_nonsensical_input_is_refused_naming_the_values(bad: dict[str, float]) -> None:
    args = {"state_bytes": GiB, "step_s": 0.02, "disk_bytes_per_s": 500.0 * MiB, "multiple": 10} | bad
    with pytest.raises(ValueError, match="absorbed_interval needs"):
        absorbed_interval(**args)  # type: ignore[arg-type]


def test_dd_measures_a_rate_and_leaves_no_file(tmp_path: Path) -> None:
    rate = dd_write_bytes_per_s(tmp_path, 8 * MiB)
    assert rate > MiB and list(tmp_path.iterdir()) == []


def test_save_every_runs_the_base_first_and_the_absorbed_interval_last() -> None:
    assert parse_intervals(f"50,{ABSORBED},0") == ["0", "50", ABSORBED]
    assert parse_intervals("100") == ["100"]
    assert parse_intervals("10, 0, 50") == ["0", "10", "50"]


@pytest.mark.parametrize(
    ("text", "why"),
    [("absorbed,50", "needs 0"), ("0,fast", "neither a number"), ("0,50,50", "each interval once"), ("", "at least")],
)
def test_save_every_refuses_what_it_cannot_run(text: str, why: str) -> None:
    with pytest.raises(SystemExit, match=why):
        parse_intervals(text)
