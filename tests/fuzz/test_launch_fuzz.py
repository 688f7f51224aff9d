"""The launch path fuzzed with the API fuzzer's specs: every job spec that a submit accepts (the API's own OpenAPI
schema drives the generation, as in ``test_api_fuzz``) reaches a real process start on a node: the agent's
environment, torchrun command line and working directory go through ``subprocess.Popen`` (the program run is
``/bin/true`` with torchrun's arguments, so nothing trains). Before the submit checks of issue 48 (H1), a NUL byte in
an ``env`` value or ``args`` item passed the API and raised ``ValueError: embedded null byte`` there, which ended the
agent and every job of its node."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from pydantic import ValidationError

from elastic.etcd import MemoryEtcdServer
from service.agent.node import create_agent
from service.api.app import create_app
from service.core.config import AgentSettings, EtcdOptions, Settings
from service.core.keys import load
from service.core.models import Assignment, JobSpec, WorkerReport, submit_problems

# one unit of the parallel run: the guard at the end reads what the fuzz test launched in the same process
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("launch_fuzz")]


class _Started:
    """A started process, as the agent handles one."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def stop(self, grace: timedelta) -> int:
        self._popen.kill()
        return self._popen.wait(grace.total_seconds() + 5)

    def tail(self) -> str:
        return ""


def _true_with_torchruns_arguments(cmd: Sequence[str], env: Mapping[str, str], cwd: str, log: Path) -> _Started:
    """The launch's process start with everything the agent built (arguments, environment, working directory):
    ``/bin/true`` runs instead of the interpreter."""
    return _Started(subprocess.Popen(["/bin/true", *cmd[1:]], env=dict(env), cwd=cwd, stdout=subprocess.DEVNULL))


def _submit_body_strategy() -> Any:
    app = create_app(Settings(etcd=EtcdOptions("127.0.0.1:9"), prefix="/f", tokens=None), MemoryEtcdServer().client())
    return schemathesis.openapi.from_dict(app.openapi())["/v1/jobs"]["POST"].as_strategy()


SUBMITS = _submit_body_strategy()
LAUNCHED: list[int] = []


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=SUBMITS)
def test_every_spec_a_submit_accepts_starts_a_process_on_a_node(case: Any, tmp_path_factory: Any) -> None:
    try:
        spec = JobSpec.model_validate(case.body)
    except (ValidationError, TypeError):
        assume(False)
        return
    assume(not submit_problems(spec))
    LAUNCHED.append(1)
    work = tmp_path_factory.mktemp("launch")
    if not spec.working_dir or not Path(spec.working_dir).is_dir():
        spec = spec.model_copy(update={"working_dir": str(work)})  # a missing directory fails the job, rightly
    client = MemoryEtcdServer().client()
    agent = create_agent(
        AgentSettings(
            etcd=EtcdOptions("127.0.0.1:9"),
            node_name="n1",
            prefix="/f",
            work_dir=work / "agent",
            rdzv_host="127.0.0.1",
            python=sys.executable,
            lease_ttl=timedelta(seconds=2),
        ),
        client,
        launcher=_true_with_torchruns_arguments,
    )
    try:
        a = Assignment(job_id="job-1", generation=1, spec=spec, assigned_at=datetime.now(timezone.utc))
        agent.sync({"job-1": a})
        kv, _ = client.get(agent.store.keys.report("job-1", "n1"))
        report = load(WorkerReport, kv) if kv is not None else None
        assert report is not None and report.state == "running", (report, case.body)
    finally:
        agent.shutdown()


def test_the_fuzzer_reached_the_launch(request: pytest.FixtureRequest) -> None:
    """Guards the test above against a generator whose specs the submit checks all refuse (nothing launched)."""
    if "test_every_spec_a_submit_accepts_starts_a_process_on_a_node" not in {i.name for i in request.session.items}:
        pytest.skip("the fuzz test did not run in this session")
    assert len(LAUNCHED) >= 10, LAUNCHED
