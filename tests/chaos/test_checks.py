"""The chaos suite's pass conditions detect what they claim to (synthetic records, real files)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tests.chaos.checks import (
    ApiHistory,
    check_exactly_once,
    check_partitions_dropped_and_rejoined,
    check_replicas_identical,
    durable_resume_points,
    effective,
    training_impact,
)


def _run(attempt: str, steps: range, world: int, t0: float, samples_per_step: int = 4) -> list[dict[str, Any]]:
    out = []
    for i, step in enumerate(steps):
        first = (step - 1) * samples_per_step
        share = samples_per_step // world
        for rank in range(world):
            idx = list(range(first + rank * share, first + (rank + 1) * share))
            out.append({"step": step, "epoch": (first // 8), "rank": rank, "world": world, "attempt": attempt,
                        "t": t0 + i, "indices": [i % 8 for i in idx]})  # fmt: skip
    return out


def test_rolled_back_steps_are_replaced_by_the_resumed_attempt_and_pass() -> None:
    # attempt a commits 1..3, is killed; b resumes from the snapshot at step 2 and re-does 3, then 4.
    records = _run("a", range(1, 4), 2, 0.0) + _run("b", range(3, 5), 2, 10.0)
    assert {s: rs[0]["attempt"] for s, rs in effective(records).items()} == {1: "a", 2: "a", 3: "b", 4: "b"}
    assert check_exactly_once(records, samples=8, epochs=2, steps_per_epoch=2) == []


def test_a_skipped_step_and_a_repeated_sample_are_reported() -> None:
    records = _run("a", range(1, 5), 2, 0.0)
    gap = [r for r in records if r["step"] != 2]
    problems = check_exactly_once(gap, samples=8, epochs=2, steps_per_epoch=2)
    assert any("missing [2]" in p for p in problems) and any("never" in p for p in problems)
    records[0]["indices"] = records[1]["indices"]  # rank 0 and rank 1 saw the same samples at step 1
    assert any("more than once" in p for p in check_exactly_once(records, 8, 2, 2))
    missing_rank = [r for r in _run("a", range(1, 5), 2, 0.0) if not (r["step"] == 3 and r["rank"] == 1)]
    assert any("ranks [0]" in p for p in check_exactly_once(missing_rank, 8, 2, 2))


def test_replicas_that_differ_or_a_missing_rank_are_reported(tmp_path: Path) -> None:
    params = {"w": torch.ones(3)}
    for rank in range(2):
        torch.save(params, tmp_path / f"final_params.rank{rank}.pt")
        (tmp_path / f"final.rank{rank}.json").write_text(json.dumps({"attempt": "x", "step": 4, "world": 2}))
    assert check_replicas_identical(tmp_path) == []
    torch.save({"w": torch.tensor([1.0, 1.0, 1.0 + 1e-7])}, tmp_path / "final_params.rank1.pt")
    assert check_replicas_identical(tmp_path) == ["rank 1's final parameters differ from rank 0's"]
    (tmp_path / "final.rank1.json").write_text(json.dumps({"attempt": "older", "step": 4, "world": 2}))
    assert "ranks [0] only" in check_replicas_identical(tmp_path)[0]


def test_api_history_reports_a_lost_event_a_changed_record_and_counters_going_back() -> None:
    job = {"id": "j", "created_at": "t", "spec": {"a": 1}, "submitted_by": "u", "checkpoint": {"url": "file:///c"},
           "generation": 2, "restarts": {"failure": 1, "membership": 3, "in_place": 0}}  # fmt: skip
    events = [{"id": "1", "type": "submitted"}, {"id": "2", "type": "started"}]
    h = ApiHistory()
    h.observe(job, events)
    h.observe(job, [*events, {"id": "3", "type": "node_lost"}])
    assert h.problems == []
    h.observe({**job, "generation": 1, "restarts": {"failure": 0, "membership": 3, "in_place": 0}}, events)
    assert any("event 3 (node_lost) disappeared" in p for p in h.problems)
    assert any("generation went back" in p for p in h.problems)
    assert any("restarts[failure] went back" in p for p in h.problems)
    h.observe({**job, "spec": {"a": 2}}, [*events, {"id": "3", "type": "node_lost"}])
    assert any("the job record changed" in p for p in h.problems)


def test_a_partitioned_node_must_be_dropped_after_the_cut_and_join_again_after_that() -> None:
    def ev(t: float, kind: str, node: str) -> dict[str, Any]:
        stamp = datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"id": str(t), "time": stamp, "type": kind, "message": "", "data": {"node": node}}

    events = [ev(100, "node_lost", "n2"), ev(200, "node_lost", "n2"), ev(205, "node_joined", "n2"),
              ev(300, "node_lost", "n3")]  # fmt: skip
    assert check_partitions_dropped_and_rejoined([("n2", 199.0, 204.0)], events) == []
    assert "never dropped" in check_partitions_dropped_and_rejoined([("n1", 0.0, 5.0)], events)[0]
    assert "never rejoined" in check_partitions_dropped_and_rejoined([("n3", 299.0, 305.0)], events)[0]
    assert "never dropped" in check_partitions_dropped_and_rejoined([("n2", 201.0, 204.0)], events)[0]  # lost before
    # the job's workers finished before n3 could rejoin, or n3 was never healed: no rejoin expected
    done = [*events, ev(310, "workers_succeeded", "n1")]
    assert check_partitions_dropped_and_rejoined([("n3", 299.0, 305.0)], done) == []
    assert check_partitions_dropped_and_rejoined([("n3", 299.0, None)], events) == []


def _steps(attempt: str, steps: range, t0: float, dt: float) -> list[dict[str, Any]]:
    return [{"step": s, "epoch": 0, "rank": 0, "world": 1, "attempt": attempt, "t": t0 + i * dt, "indices": [s]}
            for i, s in enumerate(steps)]  # fmt: skip


def test_training_impact_counts_a_restart_the_steps_done_twice_and_the_time_lost() -> None:
    # 0.1 s a step; at t=10 (step 100 done) the group dies having committed up to 103; a new group resumes
    # from 99 at t=15 and goes on at the same pace
    records = _steps("a", range(1, 104), 0.1, 0.1) + _steps("b", range(100, 300), 15.0, 0.1)
    impact = training_impact(records, began=10.05, until=20.0)
    assert impact["restarted"] and impact["new_groups"] == 1 and impact["redone_steps"] == 4
    # steps 100-103 were done again: the effective trajectory runs from step 99 (t=9.9) to the first step at or
    # after t=20 (step 150, t=20.0): 51 steps in 10.1 s, of which 5 s were lost
    assert impact["step_s"] == 0.1 and impact["window_s"] == 10.1 and impact["lost_s"] == 5.0
    assert impact["lost_pct"] == 49.5


def test_training_impact_of_a_disturbance_training_ran_through_is_nil() -> None:
    records = _steps("a", range(1, 400), 0.0, 0.1)
    impact = training_impact(records, began=20.0, until=30.0)
    assert not impact["restarted"] and impact["redone_steps"] == 0
    assert abs(impact["lost_s"]) < 1e-6 and abs(impact["lost_pct"]) < 1e-6
    # too little training before it: no pace, no time measured (the restart count still is)
    assert training_impact(records, began=0.5, until=5.0)["lost_s"] is None


def test_durable_resume_points_leave_out_fresh_starts_and_node_local_resumes() -> None:
    records = _steps("a", range(1, 10), 0.0, 0.1) + _steps("b", range(7, 12), 2.0, 0.1)
    records += [{**r, "resumed_from": "node-local"} for r in _steps("c", range(11, 14), 3.0, 0.1)]
    records += _steps("d", range(7, 9), 4.0, 0.1)
    assert durable_resume_points(records) == {6: "b"}
