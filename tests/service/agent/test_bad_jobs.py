"""One job's bad input fails that job alone: a spec no process can be given (a NUL byte in its environment,
arguments or working directory) reaches the agent's real launch path (``TorchrunProcess.start``), which refuses
it; the agent reports that job ``launch_failed`` and keeps running, and its other jobs start and keep running."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from elastic.etcd import MemoryEtcdClient, MemoryEtcdServer
from elastic.testing.wait import wait_until
from service.agent.node import NodeAgent, create_agent
from service.core.config import AgentSettings, EtcdOptions
from service.core.keys import dump, load
from service.core.models import Assignment, JobSpec, WorkerReport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client() -> MemoryEtcdClient:
    return MemoryEtcdServer().client()


@pytest.fixture
def agent(client: MemoryEtcdClient, tmp_path: Path) -> Iterator[NodeAgent]:
    settings = AgentSettings(
        etcd=EtcdOptions("127.0.0.1:9"),  # the workers' torchrun never reaches it: they are stopped by the test
        node_name="n1",
        prefix="/t",
        work_dir=tmp_path / "work",
        rdzv_host="127.0.0.1",
        lease_ttl=timedelta(seconds=2),
        poll_interval=timedelta(seconds=0.2),
        stop_grace=timedelta(seconds=2),
        python=sys.executable,
    )
    made = create_agent(settings, client)  # no launcher: the real TorchrunProcess.start
    yield made
    made.shutdown()


def _assignment(tmp_path: Path, job_id: str, **spec: object) -> Assignment:
    """An assignment as a stored job (from before submits refused NUL, or written into etcd) would give it:
    built without validation, since the API now refuses such a spec."""
    valid = JobSpec(name="job", entrypoint="train.py", working_dir=str(tmp_path), warm_start=False)
    return Assignment(
        job_id=job_id, generation=1, spec=valid.model_copy(update=spec), assigned_at=datetime.now(timezone.utc)
    )


def _report(agent: NodeAgent, job_id: str) -> WorkerReport | None:
    kv, _ = agent.client.get(agent.store.keys.report(job_id, "n1"))
    return None if kv is None else load(WorkerReport, kv)


@pytest.mark.parametrize(
    "bad",
    [{"env": {"X": "a\0b"}}, {"args": ["--x", "a\0b"]}, {"working_dir": "/tmp/a\0b"}],
    ids=["env-value", "args-item", "working-dir"],
)
def test_a_nul_byte_in_a_spec_fails_that_job_alone_and_the_agents_other_job_starts(
    agent: NodeAgent, tmp_path: Path, bad: dict[str, object]
) -> None:
    """Before the fix the ``ValueError: embedded null byte`` left ``sync`` (and ``NodeAgent.run``, which catches
    only etcd errors): the agent exited and stopped every job of the node."""
    assignments = {"bad-1": _assignment(tmp_path, "bad-1", **bad), "good-1": _assignment(tmp_path, "good-1")}
    agent.sync(assignments)
    failed = _report(agent, "bad-1")
    assert failed is not None and failed.state == "launch_failed", failed
    assert failed.error, failed
    assert set(agent.running_jobs()) == {"good-1"}
    good = _report(agent, "good-1")
    assert good is not None and good.state == "running"
    agent.sync(assignments)  # the same assignment again: not retried, the good job left alone
    assert set(agent.running_jobs()) == {"good-1"}
    assert _report(agent, "bad-1") == failed


def test_the_agents_loop_survives_a_bad_job_written_into_etcd_and_starts_the_next_one(
    agent: NodeAgent, client: MemoryEtcdClient, tmp_path: Path
) -> None:
    """The whole path: the assignment is read from etcd by the agent's own loop (``run``), as on a node."""
    keys = agent.store.keys
    client.put(keys.assignment("n1", "bad-1"), dump(_assignment(tmp_path, "bad-1", env={"X": "a\0b"})))
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    loop.start()
    try:
        assert wait_until(lambda: _report(agent, "bad-1") is not None, timeout=20), "no report of the bad job"
        assert _report(agent, "bad-1").state == "launch_failed"  # type: ignore[union-attr]
        client.put(keys.assignment("n1", "good-1"), dump(_assignment(tmp_path, "good-1")))
        assert wait_until(lambda: "good-1" in agent.running_jobs(), timeout=20), "the next job did not start"
        assert loop.is_alive()
    finally:
        stop.set()
        loop.join(30)
    assert not loop.is_alive()
