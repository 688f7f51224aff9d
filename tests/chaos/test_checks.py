"""The chaos suite's pass conditions detect what they claim to (synthetic records, real files)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.chaos.checks import (
    ApiHistory,
    RecordReader,
    check_exactly_once,
    check_partitions_dropped_and_rejoined,
    check_reforms_redo_nothing,
    check_replicas_identical,
    check_step_digests,
    check_undisturbed_workers_kept,
    durable_resume_points,
    effective,
    founded_attempts,
    label_live_attempts,
    read_records,
    training_impact,
)


def _run(attempt: str, steps: range, world: int, t0: float, samples_per_step: int = 4) -> list[dict[str, Any]]:
    out = []
    for i, step in enumerate(steps):
        first = (step - 1) * samples_per_step
        share = samples_per_step // world
        for rank in range(world):
            idx = list(range(first + rank * share, first + (rank + 1) * share))
            out.append(
                {
                    "step": step,
                    "epoch": (first // 8),
                    "rank": rank,
                    "world": world,
                    "attempt": attempt,
                    "t": t0 + i,
                    "indices": [i % 8 for i in idx],
                }
            )
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
    job = {
        "id": "j",
        "created_at": "t",
        "spec": {"a": 1},
        "submitted_by": "u",
        "checkpoint": {"url": "file:///c"},
        "generation": 2,
        "restarts": {"failure": 1, "membership": 3, "in_place": 0},
    }
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

    events = [
        ev(100, "node_lost", "n2"),
        ev(200, "node_lost", "n2"),
        ev(205, "node_joined", "n2"),
        ev(300, "node_lost", "n3"),
    ]
    assert check_partitions_dropped_and_rejoined([("n2", 199.0, 204.0)], events) == []
    assert "never dropped" in check_partitions_dropped_and_rejoined([("n1", 0.0, 5.0)], events)[0]
    assert "never rejoined" in check_partitions_dropped_and_rejoined([("n3", 299.0, 305.0)], events)[0]
    assert "never dropped" in check_partitions_dropped_and_rejoined([("n2", 201.0, 204.0)], events)[0]  # lost before
    # the job's workers finished before n3 could rejoin, or n3 was never healed: no rejoin expected
    done = [*events, ev(310, "workers_succeeded", "n1")]
    assert check_partitions_dropped_and_rejoined([("n3", 299.0, 305.0)], done) == []
    assert check_partitions_dropped_and_rejoined([("n3", 299.0, None)], events) == []


def _steps(attempt: str, steps: range, t0: float, dt: float) -> list[dict[str, Any]]:
    return [
        {"step": s, "epoch": 0, "rank": 0, "world": 1, "attempt": attempt, "t": t0 + i * dt, "indices": [s]}
        for i, s in enumerate(steps)
    ]


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


# -- live recovery -----------------------------------------------------------------------------------------
def _live(gen: int, steps: range, nodes: list[str], t0: float, pids: dict[str, int]) -> list[dict[str, Any]]:
    """One live generation on ``nodes`` (rank = position), each node's worker ``pids[node]``."""
    out = _run(f"gen{gen}", steps, len(nodes), t0)
    for r in out:
        node = nodes[r["rank"]]
        r.update(gen=gen, late=False, pid=pids[node], agent=node, digest=f"d{r['step']}")
    return out


def test_live_a_reform_with_late_records_is_one_record_set_per_step_and_passes() -> None:
    pids = {"n1": 11, "n2": 12, "n3": 13}
    # gen1 on three nodes commits 1..2; n3 dies in step 3 after its all-reduce: n1 and n2 record step 3 late for
    # themselves and for n3's rank 2 (with their own pid), then gen2 on two nodes continues with step 4
    records = _live(1, range(1, 3), ["n1", "n2", "n3"], 0.0, pids)
    late = _live(1, range(3, 4), ["n1", "n2", "n3"], 5.0, pids)
    for r in late:
        r.update(late=True, digest="after-the-reform")
        if r["agent"] == "n3":
            r.update(pid=11, agent="n1")
    records += late + _live(2, range(4, 6), ["n1", "n2"], 6.0, pids)
    labelled = label_live_attempts(records, [(-1.0, 1)])
    assert {r["attempt"] for r in labelled} == {"g1.gen1", "g1.gen2"}
    assert founded_attempts(labelled) == {"g1.gen1"}  # gen2 kept survivors: a re-form, not a new start
    assert durable_resume_points(labelled, live=True) == {}  # nothing resumed from storage
    assert check_step_digests(labelled) == [] and check_reforms_redo_nothing(labelled) == []
    eff = effective(labelled)
    assert sorted(r["rank"] for r in eff[3]) == [0, 1, 2] and {r["world"] for r in eff[4]} == {2}
    assert check_undisturbed_workers_kept(labelled, []) == []  # nobody's process was replaced
    impact = training_impact(labelled, 4.5, 6.5, live=True)
    assert (impact["reforms"], impact["new_groups"], impact["redone_steps"], impact["restarted"]) == (1, 0, 0, False)


def test_live_replicas_that_differ_after_a_step_are_reported_but_late_records_are_not_compared() -> None:
    records = _live(1, range(1, 4), ["n1", "n2"], 0.0, {"n1": 1, "n2": 2})
    records[3]["digest"] = "other"  # step 2, rank 1
    records[5].update(late=True, digest="whatever")  # step 3, rank 1: late
    problems = check_step_digests(records)
    assert len(problems) == 1 and problems[0].startswith("step 2 (gen1): replicas differ")


def test_live_a_replaced_worker_needs_a_fault_on_its_own_node() -> None:
    records = _live(1, range(1, 4), ["n1", "n2", "n3"], 0.0, {"n1": 11, "n2": 12, "n3": 13})
    # at t=10 gen2 starts with new processes on n2 and n3: only n3 was hit (t=8)
    records += _live(2, range(4, 6), ["n1", "n2", "n3"], 10.0, {"n1": 11, "n2": 22, "n3": 23})
    faults = [(8.0, "n3", "worker_kill on worker 13 on n3"), (9.0, None, "controller_restart on controller")]
    problems = check_undisturbed_workers_kept(records, faults)
    assert len(problems) == 1 and "worker 22 on n2" in problems[0] and "controller_restart" in problems[0]
    assert check_undisturbed_workers_kept(records, [*faults, (9.5, "n2", "agent_kill on agent n2")]) == []
    impact = training_impact(records, 7.0, 12.0, live=True)
    assert (impact["new_groups"], impact["restarted"]) == (2, True)
    unnamed = [{**r, "agent": None} for r in records]
    assert "name no node" in check_undisturbed_workers_kept(unnamed, faults)[0]


def test_live_a_founded_generation_may_redo_steps_a_reformed_one_may_not() -> None:
    pids = {"n1": 1, "n2": 2}
    records = _live(1, range(1, 6), ["n1", "n2"], 0.0, pids)
    # every member gone: new processes found gen2 and resume from the snapshot of step 3
    records += _live(2, range(4, 7), ["n1", "n2"], 10.0, {"n1": 3, "n2": 4})
    assert founded_attempts(records) == {"gen1", "gen2"} and check_reforms_redo_nothing(records) == []
    assert durable_resume_points(records, live=True) == {3: "gen2"}
    # a re-formed generation (a survivor, pid 3) going back to step 5: a bug
    records += _live(3, range(5, 7), ["n1", "n2"], 20.0, {"n1": 3, "n2": 5})
    problems = check_reforms_redo_nothing(records)
    assert problems == [
        "gen3, not founded anew, recorded 2 step(s) that another generation had committed before: "
        "5 (first by gen1), 6 (first by gen2)"
    ]


def test_live_generation_numbers_start_again_in_each_job_generation() -> None:
    # job generation 1's group reached gen2; the job restarted (generation 2): its live group counts from 1 again
    records = _live(1, range(1, 3), ["n1"], 0.0, {"n1": 1}) + _live(2, range(3, 5), ["n1"], 5.0, {"n1": 1})
    records += _live(1, range(3, 6), ["n1"], 20.0, {"n1": 2})
    labelled = label_live_attempts(records, [(-1.0, 1), (15.0, 2)])
    assert sorted({r["attempt"] for r in labelled}) == ["g1.gen1", "g1.gen2", "g2.gen1"]
    assert check_exactly_once(labelled, samples=8, epochs=2, steps_per_epoch=2) != []  # 5 steps of 4: not a run
    assert {s: rs[0]["attempt"] for s, rs in effective(labelled).items()}[3] == "g2.gen1"


def test_live_final_replicas_are_grouped_by_the_live_generation(tmp_path: Path) -> None:
    params = {"w": torch.ones(3)}
    for rank in range(2):  # each node's torchrun round is a world of its own: "attempt" differs per node
        torch.save(params, tmp_path / f"final_params.rank{rank}.pt")
        final = {"attempt": f"node{rank}:29500:1", "gen": 4, "step": 9, "world": 2}
        (tmp_path / f"final.rank{rank}.json").write_text(json.dumps(final))
    assert check_replicas_identical(tmp_path, live=True) == []
    assert check_replicas_identical(tmp_path) == ["final state of ranks [0] only, for a world of 2"]


def test_the_node_a_fault_disturbed_is_read_from_its_target_and_live_runs_carry_their_mode() -> None:
    from tests.chaos.model import ChaosConfig, FaultKind
    from tests.chaos.runner import fault_node

    assert fault_node(FaultKind.WORKER_KILL, "worker 4242 on node-2") == "node-2"
    assert fault_node(FaultKind.TORCHRUN_STOP, "torchrun 17 on node-3") == "node-3"
    assert fault_node(FaultKind.AGENT_STOP, "agent node-1") == "node-1"
    assert fault_node(FaultKind.NETWORK_PARTITION, "node node-3 (10.77.0.4) for 4.2 s") == "node-3"
    assert fault_node(FaultKind.CONTROLLER_RESTART, "controller") is None
    assert fault_node(FaultKind.ETCD_MEMBER_LOSS, "etcd member 1") is None
    config = ChaosConfig(recovery="live")
    assert config.live and ChaosConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="recovery"):
        ChaosConfig(recovery="inplace")


def test_the_incremental_record_reader_returns_what_a_full_read_does_as_files_grow_and_lines_are_cut(
    tmp_path: Path,
) -> None:
    read = RecordReader(tmp_path)
    assert read() == [] == read_records(tmp_path)
    a = tmp_path / "rank0.1.jsonl"
    a.write_text('{"step": 1}\n{"step": 2}\n')
    assert read() == read_records(tmp_path) == [{"step": 1}, {"step": 2}]
    with a.open("a") as f:
        f.write('{"step": 3}\n{"ste')  # a line being written (or cut by a kill): not a record
    assert read() == read_records(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    with a.open("a") as f:
        f.write('p": 4}')  # whole, its newline not yet written: counted, as by read_records
    assert read() == read_records(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3}, {"step": 4}]
    with a.open("a") as f:
        f.write('\n{"step": 5}\n')
    (tmp_path / "rank1.2.jsonl").write_text('{"step": 9}\n')
    first = read()
    assert first == read_records(tmp_path) and [r["step"] for r in first] == [1, 2, 3, 4, 5, 9]
    first[0]["step"] = 100  # the caller's copy
    assert read()[0] == {"step": 1}
