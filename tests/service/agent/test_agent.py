"""The node agent on a real etcd with real torchrun processes (one-node jobs, plain-Python workers)."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from elastic.etcd import create_client
from elastic.prefork import forked_worker, worker_tree
from elastic.proctree import alive, process_stat
from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from elastic.testing.wait import wait_for
from service.agent.launcher import TorchrunProcess
from service.agent.node import AgentError, NodeAgent, create_agent
from service.core.config import AgentSettings, EtcdOptions
from service.core.models import Assignment, JobSpec, WorkerReport
from service.core.store import create_store

pytestmark = pytest.mark.timeout(90)

_WORKER = """
import os, sys, time
mode = sys.argv[1]
env = os.environ
print("worker", env["RANK"], env["ETRAIN_JOB_ID"], env["ETRAIN_CHECKPOINT_URL"], flush=True)
if mode == "fail":
    print("boom: bad input", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "sleep":
    time.sleep(300)
"""


def _settings(etcd: LocalEtcdCluster, prefix: str, tmp_path: Path, name: str = "n1", **kw: object) -> AgentSettings:
    base: dict[str, object] = {
        "etcd": EtcdOptions(etcd.endpoints),
        "node_name": name,
        "prefix": prefix,
        "work_dir": tmp_path / "work",
        "rdzv_host": "127.0.0.1",
        "lease_ttl": timedelta(seconds=1),
        "poll_interval": timedelta(seconds=0.2),
        "stop_grace": timedelta(seconds=5),
    }
    base.update(kw)
    return AgentSettings(**base)  # type: ignore[arg-type]


@pytest.fixture
def running_agent(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[NodeAgent]:
    agent = create_agent(_settings(etcd_server, key_prefix, tmp_path, health_port=free_port()))
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: agent.healthy()[0])
    yield agent
    stop.set()
    thread.join(timeout=30)


def _assign(agent: NodeAgent, tmp_path: Path, mode: str, generation: int = 1) -> Assignment:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    a = Assignment(
        job_id="job-1",
        generation=generation,
        spec=JobSpec(name="job", entrypoint=str(script), args=[mode], rendezvous={"last_call_timeout": 1}),  # type: ignore[arg-type]
        checkpoint_url="file:///ck/job-1",
        assigned_at=datetime.now(timezone.utc),
    )
    agent.client.put(agent.store.keys.assignment(agent.settings.node_name, "job-1"), a.model_dump_json().encode())
    return a


def _report(agent: NodeAgent) -> WorkerReport | None:
    kv, _ = agent.client.get(agent.store.keys.report("job-1", agent.settings.node_name))
    return WorkerReport.model_validate_json(kv.value) if kv else None


def test_agent_registers_serves_health_and_leaves_on_stop(
    etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    agent = create_agent(_settings(etcd_server, key_prefix, tmp_path, nproc_per_node=2, health_port=port))
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: agent.healthy()[0])
    nodes, _ = agent.store.list_nodes()
    assert [(n.name, n.capacity, n.rdzv_host) for n in nodes] == [("n1", 2, "127.0.0.1")]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {
            "status": "ok",
            "node": "n1",
            "jobs": 0,
            "stopping": 0,
        }
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    observer = create_client(etcd_server.config())  # the agent closed its own client on its way out
    try:
        assert create_store(observer, key_prefix).list_nodes()[0] == []
    finally:
        observer.close()


def test_a_second_agent_with_a_live_name_is_refused(
    etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path
) -> None:
    first = create_agent(_settings(etcd_server, key_prefix, tmp_path))
    first.register()
    try:
        with pytest.raises(AgentError, match="registered by a live agent"):
            create_agent(_settings(etcd_server, key_prefix, tmp_path)).register()
    finally:
        first.shutdown()


def test_agent_runs_torchrun_and_reports_success(running_agent: NodeAgent, tmp_path: Path) -> None:
    _assign(running_agent, tmp_path, "ok")
    report = wait_for(lambda: (r := _report(running_agent)) and r.state == "exited" and r, timeout=60)
    assert isinstance(report, WorkerReport)
    assert (report.exit_code, report.generation, report.error) == (0, 1, None)
    log = (tmp_path / "work" / "jobs" / "job-1" / "g1" / "n1.log").read_text()
    assert "--rdzv-backend=etcd-v3" in log and "worker 0 job-1 file:///ck/job-1" in log
    # an exited generation is not started again while the assignment stays
    assert running_agent.running_jobs() == {}


def test_agent_reports_failure_with_the_log_tail(running_agent: NodeAgent, tmp_path: Path) -> None:
    _assign(running_agent, tmp_path, "fail")
    report = wait_for(lambda: (r := _report(running_agent)) and r.state == "exited" and r, timeout=60)
    assert isinstance(report, WorkerReport)
    assert report.exit_code != 0 and report.failed
    assert "boom: bad input" in (report.error or "")


def test_unassigning_stops_torchrun_and_all_its_workers(running_agent: NodeAgent, tmp_path: Path) -> None:
    _assign(running_agent, tmp_path, "sleep")
    pid = wait_for(lambda: running_agent.running_jobs().get("job-1"), timeout=30)
    assert isinstance(pid, int)
    root = process_stat(pid)
    assert root is not None
    # the worker has started: (pid, start time) each, torchrun forked from the job's zygote and what it started
    tree = wait_for(lambda: len(t := worker_tree(pid)) >= 3 and t, timeout=60)
    assert isinstance(tree, list)
    running_agent.client.delete(running_agent.store.keys.assignment("n1", "job-1"))
    report = wait_for(lambda: (r := _report(running_agent)) and r.state == "stopped" and r, timeout=30)
    assert isinstance(report, WorkerReport) and report.error == "unassigned"
    assert not alive(pid, root[1]), "torchrun outlived its stop"

    def gone() -> bool:  # by pid and start time (a pid may be reused); zombies count as gone
        return not any(alive(p, started) for p, started in tree)

    # a zygote caught while it detached (elastic.prefork) is in the snapshot too: it exits at its next check
    # of its owner, which may wait for its imports under load
    assert wait_for(gone, timeout=20, what="every process of the tree to exit")


def test_a_new_generation_replaces_the_running_one(running_agent: NodeAgent, tmp_path: Path) -> None:
    _assign(running_agent, tmp_path, "sleep", generation=1)
    first = wait_for(lambda: running_agent.running_jobs().get("job-1"), timeout=30)
    _assign(running_agent, tmp_path, "sleep", generation=2)
    second = wait_for(lambda: (p := running_agent.running_jobs().get("job-1")) != first and p, timeout=30)
    assert second and second != first
    assert not Path(f"/proc/{first}").exists() or "Z" in Path(f"/proc/{first}/stat").read_text()
    report = wait_for(lambda: (r := _report(running_agent)) and r.generation == 2 and r, timeout=30)
    assert isinstance(report, WorkerReport) and report.state == "running"


def test_a_warm_jobs_generations_fork_torchrun_from_one_zygote_of_the_job_which_goes_when_the_job_does(
    running_agent: NodeAgent, tmp_path: Path
) -> None:
    def zygote_of(generation: int) -> tuple[int, int]:
        _assign(running_agent, tmp_path, "sleep", generation=generation)
        client = wait_for(lambda: (r := _report(running_agent)) and r.generation == generation and r.pid, timeout=30)
        assert isinstance(client, int)
        torchrun = wait_for(lambda: forked_worker(client), timeout=60)  # the agent started a prefork client ...
        assert isinstance(torchrun, int)
        st = process_stat(torchrun)  # ... whose child, forked by the job's zygote, is torchrun
        assert st is not None
        zygote = process_stat(st[0])
        serving = Path(f"/proc/{st[0]}/cmdline").read_text().split("\0")
        assert zygote is not None and serving[3] == "--serve" and serving[4].endswith("-job-1.sock"), serving
        return st[0], zygote[1]

    first = zygote_of(1)
    assert zygote_of(2) == first  # the next generation's torchrun: forked by the same zygote, no torch import
    running_agent.client.delete(running_agent.store.keys.assignment("n1", "job-1"))
    assert wait_for(lambda: not alive(*first), timeout=30, what="the job's zygote to exit once the job left")


def test_a_warm_job_back_on_an_agent_of_the_same_process_forks_from_a_new_zygote_not_cold(
    etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path
) -> None:
    """The first agent stops while its zygote of the job may still be starting; told to stop, that zygote keeps its
    record until it exits. The next agent (same pid: the same owner and key) must not take it for a live zygote and
    start the job's torchrun cold once it is gone (it did, before: "no zygote ...; running cold")."""
    for round_ in (1, 2):
        agent = create_agent(_settings(etcd_server, key_prefix, tmp_path / f"a{round_}", health_port=free_port()))
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        try:
            wait_for(lambda agent=agent: agent.healthy()[0])
            if round_ == 1:  # a generation replaced by the next at once, then the agent stops
                _assign(agent, tmp_path, "sleep", generation=1)
                wait_for(lambda agent=agent: agent.running_jobs().get("job-1"), timeout=30)
                _assign(agent, tmp_path, "sleep", generation=2)
                wait_for(
                    lambda agent=agent: (r := _report(agent)) and r.generation == 2 and r.state == "running", timeout=30
                )
                continue
            _assign(agent, tmp_path, "sleep", generation=3)
            client = wait_for(lambda agent=agent: (r := _report(agent)) and r.generation == 3 and r.pid, timeout=30)
            assert isinstance(client, int)
            assert wait_for(lambda c=client: forked_worker(c), timeout=60), "torchrun ran cold"
        finally:
            stop.set()
            thread.join(timeout=30)


_IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("SIGTERM " + "ignored", flush=True)  # split: the log's first line echoes this source
time.sleep(300)
"""


def _start_stubborn(cmd: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path) -> TorchrunProcess:
    """A launcher whose "torchrun" is a real process that ignores SIGTERM: the agent has to wait out its
    stop grace, then SIGKILL it."""
    return TorchrunProcess.start([sys.executable, "-c", _IGNORES_SIGTERM], env, cwd, log_path)


def _get_health(port: int) -> tuple[float, int, dict[str, object]]:
    """One GET /healthz with a 1 s limit: (seconds taken, HTTP status, body); status 0 if no answer came."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            status, body = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        status, body = exc.code, json.loads(exc.read())
    except TimeoutError:
        status, body = 0, {}
    return time.monotonic() - started, status, body


@pytest.mark.timeout(120)
def test_healthz_answers_within_a_second_and_stays_ok_while_a_torchrun_ignoring_sigterm_is_stopped(
    etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path
) -> None:
    # The stop lasts past the agent's staleness limit (10 s): the chart's liveness probe (3 x 10 s) must
    # not see a slow or failing /healthz while the agent waits out the grace, or it kills the agent's pod.
    port = free_port()
    settings = _settings(etcd_server, key_prefix, tmp_path, health_port=port, stop_grace=timedelta(seconds=12))
    agent = create_agent(settings, launcher=_start_stubborn)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: agent.healthy()[0])
        _assign(agent, tmp_path, "sleep")
        log = tmp_path / "work" / "jobs" / "job-1" / "g1" / "n1.log"
        wait_for(lambda: log.exists() and "SIGTERM ignored" in log.read_text(), timeout=30)
        assert _get_health(port)[1] == 200
        agent.client.delete(agent.store.keys.assignment("n1", "job-1"))
        unassigned = time.monotonic()
        answers: list[tuple[float, float, int, dict[str, object]]] = []
        while (report := _report(agent)) is None or report.state != "stopped":
            assert time.monotonic() - unassigned < 40, "the stubborn torchrun was never stopped"
            took, status, body = _get_health(port)
            answers.append((round(time.monotonic() - unassigned, 1), round(took, 2), status, body))
            time.sleep(0.25)
        stopped_after = time.monotonic() - unassigned
    finally:
        stop.set()
        thread.join(timeout=30)
    assert stopped_after >= 11, f"the stop took {stopped_after:.1f}s: the process did not ignore SIGTERM"
    assert all(took < 1 and status == 200 for _, took, status, _ in answers), answers
    during = [body for at, _, _, body in answers if 1 < at < 11]
    assert during and all(body == {"status": "ok", "node": "n1", "jobs": 0, "stopping": 1} for body in during)
    assert any(at > 10.5 for at, _, _, _ in answers)  # polled past the staleness limit
