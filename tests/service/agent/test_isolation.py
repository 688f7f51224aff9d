"""Job isolation rules (pure) and the agent's start-up checks: uid allocation, secrets' modes, refusals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pytest

from elastic.etcd.config import EtcdOptions
from elastic.etcd.memory import MemoryEtcdClient
from service.agent.isolation import (
    UidRangeExhausted,
    allocate_uid,
    allocate_uids,
    kill_processes_of,
    secret_exposure,
)
from service.agent.node import AgentError, NodeAgent
from service.core.config import AgentSettings, UidRange
from service.core.models import Assignment, Isolation, JobSpec, WorkerReport

pytestmark = pytest.mark.timeout(30)

R = UidRange(20000, 20009)


def test_a_jobs_uid_is_a_deterministic_function_of_its_id_and_the_uids_running_jobs_hold() -> None:
    assert allocate_uid("job-a", set(), R) == allocate_uid("job-a", set(), R)
    first = allocate_uid("job-a", set(), R)
    assert first in R
    assert allocate_uid("job-a", {first}, R) not in {first}  # taken: the next free one
    assert allocate_uid("job-a", {first}, R) == allocate_uid("job-a", {first}, R)


def test_uids_are_distinct_among_running_jobs_kept_while_they_run_and_released_when_they_leave() -> None:
    running = allocate_uids({}, [f"j{i}" for i in range(10)], R)
    assert sorted(running.values()) == list(range(20000, 20010))  # the whole range, each uid once
    with pytest.raises(UidRangeExhausted, match="every uid of 20000-20009"):
        allocate_uids(running, [*running, "one-more"], R)
    later = allocate_uids(running, ["j3", "j7", "new"], R)
    assert later["j3"] == running["j3"] and later["j7"] == running["j7"]  # running jobs keep theirs
    assert set(later) == {"j3", "j7", "new"} and len(set(later.values())) == 3  # the others' are released


def test_a_uid_range_is_parsed_or_refused_with_one_line() -> None:
    assert UidRange.parse("20000-29999") == UidRange(20000, 29999) and UidRange.parse("5-5").size == 1
    for bad in ("20000", "a-b", "30000-20000", "0-10", "-1-5"):
        with pytest.raises(ValueError, match="LOW"):
            UidRange.parse(bad)


def test_a_secret_readable_by_every_user_or_owned_by_a_job_uid_is_named(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("x")
    f.chmod(0o600)
    assert secret_exposure(f, R) is None
    f.chmod(0o644)
    assert "readable by every user (mode 0644" in (secret_exposure(f, R) or "")
    if os.geteuid() == 0:
        f.chmod(0o600)
        os.chown(f, 20003, 0)
        assert "owned by uid 20003, one of the jobs' uids" in (secret_exposure(f, R) or "")
        os.chown(f, 0, 20004)
        f.chmod(0o640)
        assert "readable by group 20004" in (secret_exposure(f, R) or "")


def _settings(
    work: Path, pw: Path, job_uid_range: UidRange | None = None, job_owner: str | None = None
) -> AgentSettings:
    etcd = EtcdOptions("e:1", ca_cert="ca.pem", user="agent", password_file=str(pw))
    return AgentSettings(etcd=etcd, node_name="n1", work_dir=work, job_uid_range=job_uid_range, job_owner=job_owner)


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid range needs root")
def test_an_agent_with_a_uid_range_refuses_secrets_jobs_could_read_and_a_work_dir_they_cannot_reach(
    tmp_path: Path,
) -> None:
    pw = tmp_path / "pw"
    pw.write_text("agent-pw\n")
    pw.chmod(0o644)
    with pytest.raises(AgentError, match=r"pw is readable by every user .*: jobs on this node could read it"):
        NodeAgent(_settings(tmp_path / "work", pw, job_uid_range=R), MemoryEtcdClient())
    pw.chmod(0o400)
    tmp_path.chmod(0o700)  # (pytest's own directories are root's only)
    with pytest.raises(AgentError, match=f"{tmp_path} is not searchable by other users"):
        NodeAgent(_settings(tmp_path / "work", pw, job_uid_range=R), MemoryEtcdClient())
    reachable = Path(tempfile.mkdtemp(prefix="etrain-isolation-"))
    try:
        reachable.chmod(0o755)
        agent = NodeAgent(_settings(reachable / "work", pw, job_uid_range=R), MemoryEtcdClient())
        assert agent.isolation is Isolation.UID and agent._node_info().isolation is Isolation.UID
        assert (reachable / "work" / "jobs").stat().st_mode & 0o777 == 0o711  # reachable, not listable
    finally:
        shutil.rmtree(reachable)


def test_an_agent_without_a_uid_range_says_how_its_jobs_share_its_uid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pw = tmp_path / "pw"
    pw.write_text("agent-pw\n")
    pw.chmod(0o600)
    shared = NodeAgent(_settings(tmp_path / "work", pw), MemoryEtcdClient())
    assert shared.isolation is Isolation.NONE
    assert "a job can read the others' secrets" in caplog.text
    owned = NodeAgent(_settings(tmp_path / "work", pw, job_owner="alice"), MemoryEtcdClient())
    info = owned._node_info()
    assert (info.isolation, info.owner) == (Isolation.OWNER, "alice")
    assert "only jobs of alice are placed here" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another uid needs root")
def test_a_released_uid_has_no_process_left_even_one_that_escaped_its_torchruns_tree() -> None:
    uid = 23197  # a uid no other test uses
    escaped = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[], start_new_session=True)
    try:
        assert kill_processes_of(uid) == 1
        assert escaped.wait(timeout=10) == -signal.SIGKILL
        assert kill_processes_of(uid) == 0
    finally:
        escaped.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid range needs root")
def test_a_job_whose_uid_cannot_enter_its_working_dir_fails_to_launch_saying_why(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    reachable = Path(tempfile.mkdtemp(prefix="etrain-isolation-"))
    try:
        reachable.chmod(0o755)
        etcd = EtcdOptions("e:1")
        settings = AgentSettings(etcd=etcd, node_name="n1", work_dir=reachable / "work", job_uid_range=R)
        agent = NodeAgent(settings, MemoryEtcdClient())
        spec = JobSpec.model_validate({"name": "j", "entrypoint": "train.py", "working_dir": str(tmp_path)})
        a = Assignment(
            job_id="j-1", generation=1, spec=spec, checkpoint_key="ab" * 32, assigned_at=datetime.now(timezone.utc)
        )
        agent.sync({"j-1": a})
        kv, _ = agent.client.get(agent.store.keys.report("j-1", "n1"))
        assert kv is not None
        report = WorkerReport.model_validate_json(kv.value)
        assert report.state == "launch_failed"
        assert f"the job's uid cannot enter it: {tmp_path} is not searchable by other users" in (report.error or "")
        agent.sync({})
        assert not (reachable / "work" / "jobs" / "j-1" / "private").exists()
    finally:
        shutil.rmtree(reachable)
