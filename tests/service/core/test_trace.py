"""A job's history as a Chrome trace (``service.core.trace``): the replay of the controller's events onto node
tracks, snapshots and counters, on hand-built histories and on histories the real reconcile function wrote; and
the validator catching broken traces."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.contract.progress import Progress
from service.controller.reconcile import reconcile
from service.core.models import (
    Assignment,
    CheckpointInfo,
    Event,
    JobRecord,
    JobSpec,
    JobStatus,
    NodeControl,
    NodeInfo,
    NodeMode,
    WorkerReport,
)
from service.core.states import JobState
from service.core.trace import CONTROLLER_TID, PID, SNAPSHOTS_TID, job_trace, validate_trace
from service.core.view import ClusterView, JobEntry, ReconcileConfig

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
S = 1_000_000  # microseconds per second


def _s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _ev(seconds: float, kind: str, message: str, seq: int = 0, **data: Any) -> Event:
    at = _s(seconds)
    return Event(
        id=f"{int(at.timestamp() * 1_000_000):017d}-c{seq:03d}", time=at, type=kind, message=message, data=data
    )


def _move(seconds: float, old: str, new: str, message: str, seq: int = 0) -> Event:
    return _ev(seconds, "state", f"{old} -> {new}: {message}", seq, old=old, new=new)


def _record(**spec: Any) -> JobRecord:
    base: dict[str, Any] = {"name": "j", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 3}
    return JobRecord(
        id="j-1", spec=JobSpec.model_validate({**base, **spec}), created_at=T0, checkpoint_url="file:///ckpt/j-1"
    )


def _status(**kw: Any) -> JobStatus:
    return JobStatus(created_at=T0, updated_at=T0, **kw)


# -- reading a trace back ------------------------------------------------------------------------------------
def _threads(trace: dict[str, Any]) -> dict[str, int]:
    return {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def _on(trace: dict[str, Any], track: str, ph: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
    tid = _threads(trace)[track]
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] != "M" and e.get("tid") == tid and (ph is None or e["ph"] == ph) and (name in (None, e["name"]))
    ]


def _spans(trace: dict[str, Any], track: str, prefix: str = "") -> list[tuple[str, float, float]]:
    """``(name, start s, end s)`` of the track's complete events whose name starts with ``prefix``."""
    return [
        (e["name"], e["ts"] / S, (e["ts"] + e["dur"]) / S)
        for e in _on(trace, track, "X")
        if e["name"].startswith(prefix)
    ]


def _counter(trace: dict[str, Any], name: str) -> list[tuple[float, float]]:
    return [(e["ts"] / S, e["args"]["value"]) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name]


def _agent_kill_history() -> list[Event]:
    """Generation 1 on a, b, c; c's agent is killed (lease expired) and the job re-forms on a, b; then b's
    workers fail, the job restarts as generation 2 on a, d and succeeds."""
    return [
        Event(id=f"{int(T0.timestamp() * 1e6):017d}-aabcdef", time=T0, type="submitted", message="submitted by alice"),
        _move(1, "pending", "running", "generation 1 on 3 node(s): a, b, c"),
        _ev(5, "world_size", "world size 3 on a, b, c", world_size=3, nodes=["a", "b", "c"]),
        _ev(8, "checkpoint", "checkpoint committed at step 10", step=10, path="/ckpt/j-1/step-10"),
        _ev(20, "node_lost", "node c left (lease expired)", 0, node="c"),
        _move(20, "running", "recovering", "re-forming on 2 node(s) after losing c", 1),
        _ev(23, "world_size", "world size 2 on a, b", 0, world_size=2, nodes=["a", "b"]),
        _move(23, "recovering", "running", "running on 2 node(s), world size 2", 1),
        _ev(30, "checkpoint", "checkpoint committed at step 40", step=40, path="/ckpt/j-1/step-40"),
        _ev(40, "workers_failed", "workers failed on b", 0, nodes=["b"], exit_codes={"b": 1}),
        _move(40, "running", "recovering", "restart 1/3 in 2s", 1),
        _move(43, "recovering", "running", "generation 2 on 2 node(s): a, d"),
        _ev(50, "checkpoint", "checkpoint committed at step 60", step=60, path="/ckpt/j-1/step-60"),
        _ev(60, "workers_succeeded", "workers finished on a, d", 0, nodes=["a", "d"]),
        _move(60, "running", "succeeded", "finished at step 100", 1),
    ]


def _agent_kill_trace() -> dict[str, Any]:
    status = _status(
        state=JobState.SUCCEEDED,
        generation=2,
        step=100,
        loss=0.5,
        progress_at=_s(59),
        finished_at=_s(60),
        checkpoint=CheckpointInfo(step=60, path="/ckpt/j-1/step-60", committed_at=_s(50)),
    )
    return job_trace(_record(), status, list(reversed(_agent_kill_history())), now=_s(100))


@pytest.mark.timeout(10)
def test_agent_kill_ends_the_lost_nodes_generation_and_reforms_the_survivors_on_their_own_tracks() -> None:
    trace = _agent_kill_trace()
    assert validate_trace(trace) == []
    assert _threads(trace) == {
        "controller": CONTROLLER_TID,
        "snapshots": SNAPSHOTS_TID,
        "node a": 2,
        "node b": 3,
        "node c": 4,
        "node d": 5,
    }
    # the killed agent's node: its generation ends when its lease expired, with the cause
    assert _spans(trace, "node c") == [("generation 1", 1, 20)]
    [lost] = _on(trace, "node c", "i", "node lost")
    assert lost["ts"] == 20 * S and "lease expired" in lost["args"]["cause"] and lost["args"]["generation"] == 1
    # the survivors re-form (20 s -> the world size 2 report at 23 s) inside their generation 1
    for node in ("node a", "node b"):
        assert ("re-form", 20, 23) in _spans(trace, node)
        [reform] = _on(trace, node, "X", "re-form")
        assert reform["args"]["outcome"] == "resumed" and "losing c" in reform["args"]["cause"]
    # b's workers fail: its generation ends with the cause; the restart releases a too; generation 2 on a and d
    [failed] = _on(trace, "node b", "i", "workers failed")
    assert failed["ts"] == 40 * S and failed["args"]["cause"] == "exit code 1" and failed["args"]["exit_code"] == 1
    assert _spans(trace, "node b", "generation") == [("generation 1", 1, 40)]
    assert _spans(trace, "node a", "generation") == [("generation 1", 1, 40), ("generation 2", 43, 60)]
    assert _spans(trace, "node d", "generation") == [("generation 2", 43, 60)]
    [a_g1] = [e for e in _on(trace, "node a", "X", "generation 1")]
    assert a_g1["args"]["ended"] == "released: restart 1/3 in 2s"
    assert [e["ts"] / S for e in _on(trace, "node d", "i", "workers finished")] == [60]


@pytest.mark.timeout(10)
def test_agent_kill_trace_shows_states_snapshots_and_counters_on_the_controller_and_snapshot_tracks() -> None:
    trace = _agent_kill_trace()
    assert _spans(trace, "controller") == [
        ("pending", 0, 1),
        ("running", 1, 20),
        ("recovering", 20, 23),
        ("running", 23, 40),
        ("recovering", 40, 43),
        ("running", 43, 60),
    ]
    [done] = _on(trace, "controller", "i", "succeeded")
    assert done["s"] == "p" and done["ts"] == 60 * S and done["args"]["message"] == "finished at step 100"
    assert [e["ts"] / S for e in _on(trace, "controller", "i", "submitted")] == [0]
    commits = _on(trace, "snapshots", "i", "snapshot committed")
    assert [(e["ts"] / S, e["args"]["step"], e["args"]["path"]) for e in commits] == [
        (8, 10, "/ckpt/j-1/step-10"),
        (30, 40, "/ckpt/j-1/step-40"),
        (50, 60, "/ckpt/j-1/step-60"),
    ]
    assert _counter(trace, "world_size") == [(5, 3), (23, 2)]
    assert _counter(trace, "step") == [(8, 10), (30, 40), (50, 60), (59, 100)]
    assert _counter(trace, "loss") == [(59, 0.5)]
    assert all(e["pid"] == PID for e in trace["traceEvents"])
    meta = trace["metadata"]
    assert trace["displayTimeUnit"] == "ms" and meta["time_origin"] == T0.isoformat()
    assert meta["time_origin_unix_us"] == int(T0.timestamp()) * S and meta["ts_unit"].startswith("microseconds")
    assert meta["notes"] == [] and meta["events"] == 15 and meta["events_truncated"] is False
    assert any("per-step" in line for line in meta["not_recorded"])
    json.dumps(trace, allow_nan=False)


@pytest.mark.timeout(10)
def test_running_job_spans_end_now_marked_ongoing_with_the_reform_in_progress() -> None:
    events = [
        _move(1, "pending", "running", "generation 1 on 2 node(s): a, b"),
        _ev(4, "node_joined", "node c added", 0, node="c"),
        _move(4, "running", "recovering", "scaling up to 3 node(s) with c", 1),
    ]
    status = _status(state=JobState.RECOVERING, generation=1, nodes=["a", "b", "c"])
    trace = job_trace(_record(), status, events, now=_s(10))
    assert validate_trace(trace) == []
    assert _spans(trace, "node a") == [("generation 1", 1, 10), ("re-form", 4, 10)]
    assert _spans(trace, "node c") == [("generation 1", 4, 10), ("re-form", 4, 10)]
    [c_gen] = _on(trace, "node c", "X", "generation 1")
    assert c_gen["args"]["joined"] == "added" and c_gen["args"]["ongoing"] is True
    [reform] = _on(trace, "node c", "X", "re-form")
    assert reform["args"]["outcome"] == "in progress"
    assert _spans(trace, "controller")[-1] == ("recovering", 4, 10)
    assert [e["name"] for e in _on(trace, "node c", "i")] == ["node joined"]
    assert trace["metadata"]["notes"] == []


@pytest.mark.timeout(10)
def test_failure_while_recovering_releases_every_node_though_no_state_event_was_written() -> None:
    # recovering -> recovering writes no state event: the release must be read from the failure itself
    events = [
        _move(1, "pending", "running", "generation 1 on 3 node(s): a, b, c"),
        _ev(10, "node_lost", "node c left (lease expired)", 0, node="c"),
        _move(10, "running", "recovering", "re-forming on 2 node(s) after losing c", 1),
        _ev(12, "workers_failed", "workers failed on b", 0, nodes=["b"], exit_codes={"b": -9}),
        _move(20, "recovering", "running", "generation 2 on 2 node(s): a, b"),
    ]
    status = _status(state=JobState.RUNNING, generation=2, nodes=["a", "b"])
    trace = job_trace(_record(), status, events, now=_s(30))
    assert validate_trace(trace) == []
    assert _spans(trace, "node a") == [("generation 1", 1, 12), ("re-form", 10, 12), ("generation 2", 20, 30)]
    [interrupted] = _on(trace, "node a", "X", "re-form")
    assert interrupted["args"]["outcome"] == "interrupted"
    [failed] = _on(trace, "node b", "i", "workers failed")
    assert failed["args"]["cause"] == "killed by SIGKILL"
    assert trace["metadata"]["notes"] == []


@pytest.mark.timeout(10)
def test_latest_progress_and_agent_reports_add_snapshot_stats_torchrun_instants_and_no_log_tail() -> None:
    events = [
        _move(1, "pending", "running", "generation 1 on 2 node(s): a, b"),
        _ev(6, "checkpoint", "checkpoint committed at step 5", step=5, path="/ckpt/j-1/step-5"),
    ]
    status = _status(
        state=JobState.RUNNING,
        generation=1,
        nodes=["a", "b"],
        step=7,
        loss=1.0,
        progress_at=_s(7),
        checkpoint=CheckpointInfo(step=5, path="/ckpt/j-1/step-5", committed_at=_s(6)),
    )
    progress = Progress(
        step=9,
        world_size=2,
        time=_s(8).timestamp(),
        loss=0.75,
        generation=1,
        extra={
            "snapshots_saved": 2,
            "snapshots_deferred": 1,
            "snapshots_skipped": 0,
            "last_save_seconds": 0.25,
            "lr": 0.1,
        },
    )
    reports = {
        "a": WorkerReport(job_id="j-1", node="a", generation=1, state="running", pid=11, started_at=_s(2)),
        "b": WorkerReport(
            job_id="j-1",
            node="b",
            generation=1,
            state="exited",
            pid=12,
            exit_code=3,
            started_at=_s(2),
            finished_at=_s(9),
            error="Traceback: secret-log-tail",
        ),
    }
    trace = job_trace(_record(), status, events, now=_s(10), progress=progress, reports=reports)
    assert validate_trace(trace) == []
    stats = {"snapshots_saved": 2, "snapshots_deferred": 1, "snapshots_skipped": 0, "last_save_seconds": 0.25}
    assert trace["metadata"]["snapshot_stats"] == stats
    [commit] = _on(trace, "snapshots", "i", "snapshot committed")
    assert commit["args"]["snapshot_stats"] == stats and commit["ts"] == 6 * S
    assert _counter(trace, "step") == [(6, 5), (8, 9)]  # the report newer than the status wins
    assert _counter(trace, "loss") == [(8, 0.75)]
    assert [(e["name"], e["ts"] / S) for e in _on(trace, "node a", "i")] == [("torchrun started", 2)]
    [exited] = _on(trace, "node b", "i", "torchrun exited")
    assert exited["ts"] == 9 * S and exited["args"]["exit_code"] == 3 and exited["args"]["cause"] == "exit code 3"
    assert "secret-log-tail" not in json.dumps(trace)


@pytest.mark.timeout(10)
def test_truncated_events_draw_no_guessed_first_state_and_the_status_supplies_the_last_commit() -> None:
    events = [_move(40, "recovering", "running", "running on 2 node(s), world size 2")]
    status = _status(
        state=JobState.RUNNING,
        generation=3,
        nodes=["a", "b"],
        checkpoint=CheckpointInfo(step=70, path=None, committed_at=_s(35)),
    )
    trace = job_trace(_record(), status, events, now=_s(50), events_truncated=True)
    assert validate_trace(trace) == []
    assert _spans(trace, "controller") == [("running", 40, 50)]
    assert [(e["ts"] / S, e["args"]["step"]) for e in _on(trace, "snapshots", "i")] == [(35, 70)]
    assert trace["metadata"]["events_truncated"] is True
    # the nodes' generation started before the first event given: the replay says it cannot place them
    assert "differ" in trace["metadata"]["notes"][0]


@pytest.mark.timeout(10)
def test_unknown_event_types_and_non_finite_values_still_give_strict_json() -> None:
    events = [
        _move(1, "pending", "running", "generation 1 on 2 node(s): a, b"),
        _ev(2, "node_drained", "node a drained", node="a", ratio=math.nan, nested={"deep": [math.inf]}),
        _ev(3, "quota_changed", "quota now 5", quota=5),
    ]
    trace = job_trace(_record(), _status(state=JobState.RUNNING, generation=1, nodes=["a", "b"]), events, _s(5))
    assert validate_trace(trace) == []
    json.dumps(trace, allow_nan=False)
    [drained] = _on(trace, "node a", "i", "node drained")
    assert drained["args"]["data"]["ratio"] is None and drained["args"]["data"]["nested"] == {"deep": [None]}
    assert [e["args"]["message"] for e in _on(trace, "controller", "i", "quota changed")] == ["quota now 5"]


# -- histories written by the real reconcile function ---------------------------------------------------------
CFG = ReconcileConfig(
    success_grace=timedelta(seconds=10), failure_settle=timedelta(seconds=2), resume_after=timedelta(seconds=30)
)


@dataclass
class _Sim:
    """One job under the real :func:`reconcile`, its plans applied as the store does; every event kept."""

    entry: JobEntry
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    assignments: dict[str, dict[str, Assignment]] = field(default_factory=dict)
    reports: dict[str, WorkerReport] = field(default_factory=dict)
    progress: Progress | None = None
    events: list[Event] = field(default_factory=list)
    controls: dict[str, NodeControl] = field(default_factory=dict)

    @classmethod
    def of(cls, record: JobRecord, *nodes: str) -> _Sim:
        sim = cls(JobEntry(record, _status(), 1))
        for n in nodes:
            sim.nodes[n] = NodeInfo(name=n, capacity=1, incarnation="x", registered_at=T0)
        return sim

    def tick(self, seconds: float) -> None:
        job_id = self.entry.record.id
        view = ClusterView(
            {job_id: self.entry},
            self.nodes,
            self.assignments,
            {job_id: self.reports},
            {job_id: self.progress} if self.progress else {},
            controls=self.controls,
        )
        for u in reconcile(view, _s(seconds), CFG).updates:
            if u.status is not None:
                self.entry = JobEntry(self.entry.record, u.status, self.entry.status_revision + 1)
            for node, a in u.assign.items():
                self.assignments.setdefault(node, {})[job_id] = a
            for node in u.unassign:
                self.assignments.get(node, {}).pop(job_id, None)
            if u.clear_reports:
                self.reports.clear()
            for node in u.clear_report_nodes:
                self.reports.pop(node, None)
            self.events += u.events

    def report(self, node: str, state: str, code: int | None, seconds: float) -> None:
        self.reports[node] = WorkerReport(
            job_id=self.entry.record.id,
            node=node,
            generation=self.status.generation,
            state=state,
            exit_code=code,
            finished_at=_s(seconds),
        )  # type: ignore[arg-type]

    def report_progress(self, seconds: float, step: int, world: int, nodes: list[str], **kw: Any) -> None:
        self.progress = Progress(
            step=step,
            world_size=world,
            time=_s(seconds).timestamp(),
            generation=self.status.generation,
            nodes=nodes,
            **kw,
        )

    @property
    def status(self) -> JobStatus:
        return self.entry.status

    def trace(self, now: float) -> dict[str, Any]:
        return job_trace(
            self.entry.record, self.status, self.events, _s(now), progress=self.progress, reports=self.reports
        )


@pytest.mark.timeout(20)
def test_reconcile_written_history_of_a_killed_agent_and_a_failure_while_recovering_replays_exactly() -> None:
    sim = _Sim.of(_record(), "a", "b", "c")
    sim.tick(1)  # generation 1 on a, b, c
    sim.report_progress(3, 10, 3, ["a", "b", "c"], checkpoint_step=10, checkpoint_path="/ckpt/j-1/step-10")
    sim.tick(3)
    del sim.nodes["c"]  # c's agent SIGKILLed: its lease expired
    sim.tick(10)
    assert sim.status.state == JobState.RECOVERING and sim.status.nodes == ["a", "b"]
    sim.report("b", "exited", 1, 11)  # before the re-form reported: a failure while recovering
    sim.tick(11)
    sim.tick(14)  # after failure_settle: restart after the backoff, as a new generation
    sim.tick(20)
    assert sim.status.generation == 2 and sim.status.nodes == ["a", "b"]
    assert not any(e.type == "state" and e.time == _s(14) for e in sim.events)  # recovering -> recovering
    trace = sim.trace(now=30)
    assert validate_trace(trace) == []
    assert trace["metadata"]["notes"] == []  # the replay ends on the nodes the status holds
    assert _spans(trace, "node c") == [("generation 1", 1, 10)]
    assert [e["ts"] / S for e in _on(trace, "node c", "i", "node lost")] == [10]
    assert _spans(trace, "node a") == [("generation 1", 1, 14), ("re-form", 10, 14), ("generation 2", 20, 30)]
    assert _spans(trace, "node b", "generation") == [("generation 1", 1, 14), ("generation 2", 20, 30)]
    [failed] = _on(trace, "node b", "i", "workers failed")
    assert failed["ts"] == 14 * S and failed["args"]["cause"] == "exit code 1"
    assert [e["args"]["step"] for e in _on(trace, "snapshots", "i", "snapshot committed")] == [10]
    assert _counter(trace, "world_size") == [(3, 3)]


@pytest.mark.timeout(20)
def test_a_start_event_carries_its_generation_and_nodes_and_the_trace_reads_them_not_the_message() -> None:
    sim = _Sim.of(_record(), "a", "b", "c")
    sim.tick(1)
    [start] = [e for e in sim.events if e.type == "state"]
    assert start.data == {"old": "pending", "new": "running", "generation": 1, "nodes": ["a", "b", "c"]}
    assert start.message == "pending -> running: generation 1 on 3 node(s): a, b, c"  # for people
    reworded = start.model_copy(update={"message": "pending -> running: started"})
    trace = job_trace(sim.entry.record, sim.status, [reworded], _s(5))
    assert [_spans(trace, f"node {n}") for n in "abc"] == [[("generation 1", 1, 5)]] * 3


@pytest.mark.timeout(20)
def test_reconcile_written_live_recovery_drops_the_killed_node_then_adds_it_back_in_the_same_generation() -> None:
    sim = _Sim.of(_record(min_nodes=1, max_nodes=2, recovery="live"), "a", "b")
    sim.tick(1)
    sim.report_progress(2, 5, 2, ["a", "b"])
    sim.tick(2)
    sim.report("b", "exited", -9, 3)  # b's torchrun SIGKILLed while a's workers go on
    sim.tick(3)
    sim.tick(6)  # after failure_settle: live drop
    assert sim.status.nodes == ["a"] and sim.status.generation == 1
    sim.report_progress(7, 6, 1, ["a"])
    sim.tick(7)  # resumes on a; the scale-up adds b back
    assert sim.status.nodes == ["a", "b"] and sim.status.generation == 1
    trace = sim.trace(now=9)
    assert validate_trace(trace) == []
    assert trace["metadata"]["notes"] == []
    assert _spans(trace, "node b", "generation") == [("generation 1", 1, 6), ("generation 1", 7, 9)]
    [gone, back] = _on(trace, "node b", "X", "generation 1")
    assert gone["args"]["ended"] == "workers failed (killed by SIGKILL)" and back["args"]["joined"] == "added"
    assert _spans(trace, "node a", "generation") == [("generation 1", 1, 9)]
    assert ("re-form", 6, 7) in _spans(trace, "node a")  # the survivor re-formed until world size 1 was reported
    assert _counter(trace, "world_size") == [(2, 2), (7, 1)]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("recovery", ["restart", "live"])
def test_a_drain_ends_the_drained_nodes_span_and_shows_the_move_to_the_free_node(recovery: str) -> None:
    sim = _Sim.of(_record(min_nodes=1, max_nodes=2, recovery=recovery), "a", "b", "c")
    sim.tick(1)  # generation 1 on a, b
    sim.report_progress(2, 5, 2, ["a", "b"])
    sim.tick(2)
    sim.controls["a"] = NodeControl(name="a", mode=NodeMode.DRAINING, at=_s(3))
    sim.tick(3)
    assert sim.status.nodes == ["b", "c"] and sim.status.restarts.failure == 0
    sim.report_progress(4, 6, 2, ["b", "c"])
    sim.tick(4)
    trace = sim.trace(now=6)
    assert validate_trace(trace) == []
    assert trace["metadata"]["notes"] == []
    assert _spans(trace, "node a", "generation") == [("generation 1", 1, 3)]
    [moved] = _on(trace, "controller", "i", "evacuated")
    assert moved["ts"] == 3 * S and moved["args"]["members"] == ["b", "c"]
    if recovery == "live":  # the same generation: b stays, c is added and re-forms with it
        assert _spans(trace, "node b", "generation") == [("generation 1", 1, 6)]
        assert _spans(trace, "node c", "generation") == [("generation 1", 3, 6)]
    else:  # restart mode: a new generation on b and c
        assert _spans(trace, "node b", "generation") == [("generation 1", 1, 3), ("generation 2", 3, 6)]
        assert _spans(trace, "node c", "generation") == [("generation 2", 3, 6)]
    assert ("re-form", 3, 4) in _spans(trace, "node c")


# -- the validator ----------------------------------------------------------------------------------------------
def _x(name: str, ts: float, dur: float, tid: int = 0) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _be(ph: str, name: str, ts: float, tid: int = 0) -> dict[str, Any]:
    return {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}


@pytest.mark.timeout(10)
def test_validator_accepts_nested_durations_balanced_pairs_counters_instants_and_the_array_format() -> None:
    events = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "main"}},
        _x("outer", 0, 100),
        _x("inner", 10, 20),
        _x("inner2", 30, 70),
        _be("B", "b", 5, tid=1),
        _be("B", "c", 6, tid=1),
        _be("E", "c", 7, tid=1),
        {"ph": "E", "ts": 9, "pid": 1, "tid": 1},  # an E may omit its name
        {"name": "n", "ph": "i", "s": "g", "ts": 3, "pid": 1, "tid": 0},
        {"name": "ctr", "ph": "C", "ts": 3, "pid": 1, "args": {"value": 2.5}},
    ]
    assert validate_trace({"traceEvents": events, "displayTimeUnit": "ns"}) == []
    assert validate_trace(events) == []


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([_be("B", "open", 1)], "never closed"),
        ([_be("E", "close", 1)], "no open 'B'"),
        ([_be("E", "a", 1), _be("B", "a", 2)], "no open 'B'"),  # an E before its B in time
        ([_be("B", "a", 1), _be("E", "b", 2)], "named 'a'"),
        ([_x("neg", 0, -1)], "'dur' must be"),
        ([{"name": "x", "ph": "X", "ts": 0, "pid": 1, "tid": 0}], "'dur' must be"),
        ([{"name": "x", "ph": "i", "pid": 1, "tid": 0}], "'ts' is missing"),
        ([{"name": "x", "ph": "i", "ts": -5, "pid": 1, "tid": 0}], "'ts' must be"),
        ([{"name": "x", "ph": "i", "ts": "5", "pid": 1, "tid": 0}], "'ts' must be"),
        ([{"name": "x", "ph": "i", "ts": 5, "pid": "1", "tid": 0}], "'pid' must be an integer"),
        ([{"name": "x", "ph": "i", "ts": 5, "pid": 1, "tid": True}], "'tid' must be an integer"),
        ([{"name": "x", "ph": "X", "ts": 5, "dur": 1, "pid": 1}], "'tid' is missing"),
        ([{"name": 7, "ph": "i", "ts": 5, "pid": 1, "tid": 0}], "'name' must be a string"),
        ([{"name": "x", "ph": "Q", "ts": 5, "pid": 1, "tid": 0}], "unknown or missing phase"),
        ([{"name": "x", "ph": "i", "s": "x", "ts": 5, "pid": 1, "tid": 0}], "scope 's'"),
        ([{"name": "c", "ph": "C", "ts": 5, "pid": 1, "args": {"v": "high"}}], "counter values"),
        ([{"name": "c", "ph": "C", "ts": 5, "pid": 1}], "a counter needs 'args'"),
        ([{"name": "x", "ph": "i", "ts": 5, "pid": 1, "tid": 0, "args": {"v": math.nan}}], "not JSON-serializable"),
        ([_x("a", 0, 10), _x("b", 5, 10)], "partially overlaps"),
        ([{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {}}], "args.name must be a string"),
        ([{"name": "bogus_meta", "ph": "M", "pid": 1, "args": {}}], "metadata name"),
        (["not an event"], "must be an object"),
    ],
)
@pytest.mark.timeout(10)
def test_validator_names_what_breaks_the_trace_event_format(events: list[Any], expected: str) -> None:
    errors = validate_trace({"traceEvents": events})
    assert any(expected in e for e in errors), errors


@pytest.mark.timeout(10)
def test_validator_refuses_a_malformed_container() -> None:
    assert validate_trace({"events": []}) == ["no 'traceEvents'"]
    assert validate_trace({"traceEvents": {}}) == ["'traceEvents' must be a list"]
    assert "displayTimeUnit" in validate_trace({"traceEvents": [], "displayTimeUnit": "s"})[0]
    assert "JSON object or array" in validate_trace("trace")[0]
    assert validate_trace({"traceEvents": [], "metadata": {"k": object()}})[0].startswith("not JSON-serializable")


# -- any history at all gives a valid trace -------------------------------------------------------------------
_NODES = st.sampled_from(["a", "b", "c", "d"])
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=5),
    st.lists(_NODES, max_size=4),
    st.dictionaries(_NODES, st.one_of(st.none(), st.integers(-20, 5))),
)
_DATA = {  # the data reconcile writes, and now and then anything else
    "node": _NODES,
    "nodes": st.lists(_NODES, max_size=4, unique=True),
    "exit_codes": st.dictionaries(_NODES, st.one_of(st.none(), st.integers(-20, 5))),
    "world_size": st.integers(1, 4),
    "step": st.integers(0, 100),
    "path": st.sampled_from([None, "/ckpt/j-1/step-5"]),
}
_MESSAGES = st.sampled_from(
    [
        "generation 1 on 2 node(s): a, b",
        "generation 2 on 3 node(s): a, c, d",
        "generation 7 on 1 node(s): b",
        "re-forming on 2 node(s) after losing c",
        "waiting for nodes: 1 left, min_nodes=2",
        "restart 1/3 in 2s",
        "live recovery: going on with 1 node(s) without b, whose torchrun died (failure 1/3)",
        "scaling up to 3 node(s) with d",
        "running on 2 node(s), world size 2",
        "finished at step 9",
        "",
        "x",
    ]
)
_MOVES = st.sampled_from(
    [
        ("pending", "running", "generation 1 on 2 node(s): a, b"),
        ("recovering", "running", "generation 2 on 3 node(s): a, c, d"),
        ("recovering", "running", "generation 3 on 1 node(s): b"),
        ("running", "recovering", "re-forming on 2 node(s) after losing c"),
        ("running", "recovering", "waiting for nodes: 1 left, min_nodes=2"),
        ("running", "recovering", "restart 1/3 in 2s"),
        (
            "running",
            "recovering",
            "live recovery: going on with 1 node(s) without b, whose torchrun died (failure 1/3)",
        ),
        ("running", "recovering", "scaling up to 3 node(s) with d"),
        ("recovering", "running", "running on 2 node(s), world size 2"),
        ("running", "succeeded", "finished at step 9"),
        ("recovering", "failed", "restart budget exhausted: 4 failures (max_failures=3)"),
        ("pending", "cancelled", "cancelled by request"),
    ]
)
_STATES = st.sampled_from(["pending", "running", "recovering", "succeeded", "failed", "cancelled", "odd"])
_KINDS = st.sampled_from(
    [
        "state",
        "state",
        "node_lost",
        "node_joined",
        "workers_failed",
        "workers_succeeded",
        "world_size",
        "checkpoint",
        "checkpoint_rejected",
        "node_blacklisted",
        "submitted",
        "other",
    ]
)


@st.composite
def _events(draw: st.DrawFn) -> list[Event]:
    out = []
    for seq in range(draw(st.integers(0, 30))):
        kind = draw(_KINDS)
        data = {
            key: draw(st.one_of(strategy, _VALUES) if draw(st.integers(0, 9)) == 0 else strategy)
            for key, strategy in _DATA.items()
            if draw(st.booleans())
        }
        message = draw(_MESSAGES)
        if kind == "state":
            old, new, message = draw(st.one_of(_MOVES, _MOVES, _MOVES, st.tuples(_STATES, _STATES, _MESSAGES)))
            if draw(st.booleans()):  # the data, else only the message says it (older events; or neither)
                data.update(old=old, new=new)
            message = f"{old} -> {new}: {message}" if draw(st.integers(0, 9)) else message
        out.append(_ev(draw(st.integers(0, 40)) / 2, kind, message, seq, **data))
    return out


@pytest.mark.timeout(120)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    events=_events(),
    state=st.sampled_from(list(JobState)),
    nodes=st.lists(_NODES, max_size=3, unique=True),
    truncated=st.booleans(),
    live=st.booleans(),
)
def test_any_event_history_gives_a_valid_strict_json_trace(
    events: list[Event], state: JobState, nodes: list[str], truncated: bool, live: bool
) -> None:
    status = _status(state=state, nodes=nodes, finished_at=_s(25) if state.terminal else None)
    record = _record(recovery="live" if live else "restart")
    trace = job_trace(record, status, events, now=_s(30), events_truncated=truncated)
    assert validate_trace(trace) == []
    json.dumps(trace, allow_nan=False)
