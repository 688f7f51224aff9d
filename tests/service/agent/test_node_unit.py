"""The node agent's decisions with a fake launcher and the in-memory etcd: which generations it starts and
stops for given assignments, and what it reports (no torchrun, no etcd binary)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TypeVar

import pytest

from elastic.etcd import MemoryEtcdClient, MemoryEtcdServer
from elastic.testing.wait import wait_until
from service.agent.node import NodeAgent, create_agent
from service.core.config import AgentSettings, EtcdOptions
from service.core.models import Assignment, JobSpec, WorkerReport

pytestmark = pytest.mark.timeout(30)


class FakeProcess:
    """A torchrun that runs until stopped or told to exit."""

    def __init__(self, pid: int, job_id: str, generation: int) -> None:
        self.pid = pid
        self.job_id = job_id
        self.generation = generation
        self.exit_code: int | None = None
        self.stopped = False
        self.stopping = threading.Event()  # set when a stop begins
        self.release: threading.Event | None = None  # when set up, a stop lasts until this is set

    def poll(self) -> int | None:
        return self.exit_code

    def stop(self, grace: timedelta) -> int:
        self.stopping.set()
        if self.release is not None:
            assert self.release.wait(20), "the test never released a slow stop"
        self.stopped = True
        if self.exit_code is None:
            self.exit_code = -15
        return self.exit_code

    def tail(self) -> str:
        return "Traceback: boom"


class FakeLauncher:
    """Records every start as (job id, generation); the generation is read from the log path."""

    def __init__(self) -> None:
        self.processes: list[FakeProcess] = []
        self.commands: list[list[str]] = []
        self.refuse = False
        self.slow_stops: threading.Event | None = None  # when set up, every stop waits for this event
        self._lock = threading.Lock()

    def __call__(self, cmd: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path) -> FakeProcess:
        if self.refuse:
            raise OSError("no such file: torchrun")
        job_id, generation = log_path.parent.parent.name, int(log_path.parent.name.removeprefix("g"))
        with self._lock:
            proc = FakeProcess(1000 + len(self.processes), job_id, generation)
            self.commands.append(list(cmd))
            proc.release = self.slow_stops
            self.processes.append(proc)
        return proc

    @property
    def started(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(p.job_id, p.generation) for p in self.processes]

    @property
    def stopped(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(p.job_id, p.generation) for p in self.processes if p.stopped]


@pytest.fixture
def client() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.fixture
def launcher() -> FakeLauncher:
    return FakeLauncher()


@pytest.fixture
def agent(client: MemoryEtcdClient, launcher: FakeLauncher, tmp_path: Path) -> Iterator[NodeAgent]:
    settings = AgentSettings(
        etcd=EtcdOptions("127.0.0.1:2379"),  # never dialled: the agent is handed the memory client
        node_name="n1",
        prefix="/t",
        work_dir=tmp_path / "work",
        rdzv_host="127.0.0.1",
        lease_ttl=timedelta(seconds=1),
        poll_interval=timedelta(seconds=0.2),
        python=sys.executable,
    )
    made = create_agent(settings, client, launcher=launcher)
    yield made
    made.shutdown()


# one placement of a job on the node: the controller writes an assignment anew only to place the node again
ASSIGNED = datetime.now(timezone.utc)


def _a(
    tmp_path: Path, job_id: str = "job-1", generation: int = 1, assigned_at: datetime = ASSIGNED, **spec: object
) -> Assignment:
    return Assignment(
        job_id=job_id,
        generation=generation,
        spec=JobSpec(name="job", entrypoint="train.py", working_dir=str(tmp_path), **spec),  # type: ignore[arg-type]
        assigned_at=assigned_at,
    )


def _report(agent: NodeAgent, job_id: str = "job-1") -> WorkerReport | None:
    kv, _ = agent.client.get(agent.store.keys.report(job_id, "n1"))
    return WorkerReport.model_validate_json(kv.value) if kv is not None else None


def test_a_new_assignment_starts_one_torchrun_and_reports_it_running(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path)})
    assert launcher.started == [("job-1", 1)]
    assert agent.running_jobs() == {"job-1": 1000}
    report = _report(agent)
    assert report is not None and (report.state, report.generation, report.pid) == ("running", 1, 1000)


def test_the_same_assignment_again_starts_nothing_new(agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path) -> None:
    assignment = _a(tmp_path)
    agent.sync({"job-1": assignment})
    agent.sync({"job-1": assignment})
    assert launcher.started == [("job-1", 1)] and launcher.stopped == []


def test_a_new_generation_stops_the_running_one_then_starts_it(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path, generation=1)})
    agent.sync({"job-1": _a(tmp_path, generation=2)})
    assert launcher.started == [("job-1", 1), ("job-1", 2)]
    assert launcher.stopped == [("job-1", 1)]
    report = _report(agent)
    assert report is not None and (report.state, report.generation) == ("running", 2)


def test_an_unassigned_job_is_stopped_and_reported_stopped(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path), "job-2": _a(tmp_path, "job-2")})
    agent.sync({"job-2": _a(tmp_path, "job-2")})
    assert launcher.stopped == [("job-1", 1)]
    assert agent.running_jobs() == {"job-2": 1001}
    report = _report(agent)
    assert report is not None and (report.state, report.error, report.exit_code) == ("stopped", "unassigned", -15)


def test_an_exited_generation_is_reported_and_not_started_again_until_a_new_generation(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path)})
    launcher.processes[0].exit_code = 3
    agent.sync({"job-1": _a(tmp_path)})
    agent.sync({"job-1": _a(tmp_path)})
    assert launcher.started == [("job-1", 1)] and agent.running_jobs() == {}
    report = _report(agent)
    assert report is not None and (report.state, report.exit_code, report.error) == ("exited", 3, "Traceback: boom")
    agent.sync({"job-1": _a(tmp_path, generation=2)})
    assert launcher.started == [("job-1", 1), ("job-1", 2)]


def test_a_node_placed_again_in_the_same_generation_starts_its_exited_torchrun_again(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    # live recovery: the controller drops a node whose torchrun was killed and places it again later, in the
    # same generation, maybe before this agent saw the assignment vanish
    agent.sync({"job-1": _a(tmp_path)})
    launcher.processes[0].exit_code = -9
    agent.sync({"job-1": _a(tmp_path)})
    assert launcher.started == [("job-1", 1)]
    agent.sync({"job-1": _a(tmp_path, assigned_at=ASSIGNED + timedelta(seconds=30))})
    assert launcher.started == [("job-1", 1), ("job-1", 1)] and agent.running_jobs() == {"job-1": 1001}
    report = _report(agent)
    assert report is not None and (report.state, report.generation, report.pid) == ("running", 1, 1001)


def test_a_successful_exit_is_reported_without_the_log_tail(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path)})
    launcher.processes[0].exit_code = 0
    agent.sync({"job-1": _a(tmp_path)})
    report = _report(agent)
    assert report is not None and (report.state, report.exit_code, report.error) == ("exited", 0, None)


def test_a_job_unassigned_after_exiting_and_assigned_again_starts_again(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path)})
    launcher.processes[0].exit_code = 0
    agent.sync({})
    agent.sync({"job-1": _a(tmp_path)})
    assert launcher.started == [("job-1", 1), ("job-1", 1)]


def test_a_launch_failure_is_reported_and_that_generation_is_not_retried(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    launcher.refuse = True
    agent.sync({"job-1": _a(tmp_path)})
    launcher.refuse = False
    agent.sync({"job-1": _a(tmp_path)})
    assert launcher.started == []
    report = _report(agent)
    assert report is not None and report.state == "launch_failed" and "cannot start torchrun" in (report.error or "")


def test_a_missing_working_dir_is_reported_as_a_launch_failure_without_starting(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.sync({"job-1": _a(tmp_path / "nowhere")})
    assert launcher.started == []
    report = _report(agent)
    assert report is not None and report.state == "launch_failed" and "does not exist" in (report.error or "")


def test_reports_made_while_etcd_is_unreachable_are_sent_once_it_is_back(
    agent: NodeAgent, client: MemoryEtcdClient, launcher: FakeLauncher, tmp_path: Path
) -> None:
    client.set_reachable(False)
    agent.sync({"job-1": _a(tmp_path)})  # the workers start even so
    assert launcher.started == [("job-1", 1)]
    client.set_reachable(True)
    assert _report(agent) is None
    agent.sync({"job-1": _a(tmp_path)})
    report = _report(agent)
    assert report is not None and report.state == "running"


def test_shutdown_stops_every_torchrun_and_the_node_leaves_at_once(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.register()
    assert [n.name for n in agent.store.list_nodes()[0]] == ["n1"]
    agent.sync({"job-1": _a(tmp_path), "job-2": _a(tmp_path, "job-2")})
    agent.shutdown()
    assert sorted(launcher.stopped) == [("job-1", 1), ("job-2", 1)]
    assert agent.store.list_nodes()[0] == []


def test_the_loop_follows_assignments_written_to_etcd(
    agent: NodeAgent, client: MemoryEtcdClient, launcher: FakeLauncher, tmp_path: Path
) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        key = agent.store.keys.assignment("n1", "job-1")
        client.put(key, _a(tmp_path).model_dump_json().encode())
        assert wait_until(lambda: launcher.started == [("job-1", 1)], timeout=10)
        client.put(key, _a(tmp_path, generation=2).model_dump_json().encode())
        assert wait_until(lambda: launcher.started == [("job-1", 1), ("job-1", 2)], timeout=10)
        client.delete(key)
        assert wait_until(lambda: launcher.stopped == [("job-1", 1), ("job-1", 2)], timeout=10)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert agent.store.list_nodes()[0] == []


T = TypeVar("T")


def _answer_within(seconds: float, call: Callable[[], T]) -> tuple[T | None, float]:
    """``call()`` in a thread: its result (None if it did not return in ``seconds``) and how long it took."""
    box: list[T] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    return (box[0] if box else None), time.monotonic() - started


def test_health_and_running_jobs_answer_at_once_while_a_generation_is_being_stopped(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.register()
    launcher.slow_stops = threading.Event()
    agent.sync({"job-1": _a(tmp_path), "job-2": _a(tmp_path, "job-2")})
    stopper = threading.Thread(target=agent.sync, args=({"job-2": _a(tmp_path, "job-2")},), daemon=True)
    stopper.start()
    try:
        assert launcher.processes[0].stopping.wait(5)
        health, took = _answer_within(1.0, agent.healthy)
        assert health is not None, f"healthy() blocked for {took:.1f}s behind a stopping torchrun"
        # a stop in progress is work of the loop: the agent is healthy, not stale
        assert health == (True, {"status": "ok", "node": "n1", "jobs": 1, "stopping": 1})
        jobs, took = _answer_within(1.0, agent.running_jobs)
        assert jobs == {"job-2": 1001}, f"running_jobs() gave {jobs} after {took:.1f}s"
    finally:
        launcher.slow_stops.set()
        stopper.join(10)
    assert not stopper.is_alive()
    assert launcher.stopped == [("job-1", 1)]
    assert agent.healthy() == (True, {"status": "ok", "node": "n1", "jobs": 1, "stopping": 0})
    report = _report(agent)
    assert report is not None and (report.state, report.error) == ("stopped", "unassigned")


def test_a_new_generation_starts_only_after_the_slowly_stopping_one_has_stopped(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    launcher.slow_stops = threading.Event()
    agent.sync({"job-1": _a(tmp_path, generation=1)})
    stopper = threading.Thread(target=agent.sync, args=({"job-1": _a(tmp_path, generation=2)},), daemon=True)
    stopper.start()
    try:
        assert launcher.processes[0].stopping.wait(5)
        time.sleep(0.2)
        jobs, took = _answer_within(1.0, agent.running_jobs)
        assert launcher.started == [("job-1", 1)] and jobs == {}, f"running_jobs() gave {jobs} after {took:.1f}s"
    finally:
        launcher.slow_stops.set()
        stopper.join(10)
    assert launcher.started == [("job-1", 1), ("job-1", 2)] and agent.running_jobs() == {"job-1": 1001}


def test_health_reports_how_many_jobs_run_but_never_their_ids(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    agent.register()
    agent.sync({"secret-job-a": _a(tmp_path, "secret-job-a"), "secret-job-b": _a(tmp_path, "secret-job-b")})
    body = agent.healthy()[1]
    assert body["jobs"] == 2 and body["stopping"] == 0
    text = json.dumps(body)
    assert "secret-job" not in text and "1000" not in text and "1001" not in text


def test_torchrun_meets_under_the_rendezvous_prefix_the_assignment_names_else_the_legacy_one(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    # Agents of two versions in one generation must meet in one rendezvous: the controller names the prefix
    # (a chaos run split a job in two when agents computed it themselves across an upgrade).
    agent.sync({"job-1": _a(tmp_path).model_copy(update={"rdzv_prefix": "/t.rdzv"})})
    agent.sync({"job-2": _a(tmp_path, "job-2")})
    confs = [next(c for c in cmd if c.startswith("--rdzv-conf=")) for cmd in launcher.commands]
    assert "key_prefix=/t.rdzv," in confs[0] and "key_prefix=/t/rdzv," in confs[1]


def test_an_agent_that_stops_reports_its_jobs_stopped_as_planned_and_an_unassigned_job_not(
    agent: NodeAgent, launcher: FakeLauncher, tmp_path: Path
) -> None:
    """The leader reads ``planned`` to leave the node without spending the job's membership budget (issue 50)."""
    agent.sync({"job-1": _a(tmp_path), "job-2": _a(tmp_path, "job-2")})
    agent.sync({"job-1": _a(tmp_path)})  # job-2 unassigned: stopped by the leader's decision, not planned here
    unassigned = _report(agent, "job-2")
    assert unassigned is not None and unassigned.state == "stopped" and not unassigned.planned
    agent.shutdown()
    report = _report(agent, "job-1")
    assert report is not None and report.state == "stopped" and report.planned
