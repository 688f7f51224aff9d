"""etcd over TLS (client certificates, or user/password): controller, agent and torchrun's rendezvous.

A real etcd is started with a server certificate made by ``openssl`` for 127.0.0.1; the controller and
an agent run as ``etrain`` processes and a one-node job runs through torchrun's etcd-v3 rendezvous.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from elastic.etcd import EtcdConfig, EtcdError, GrpcEtcdClient, create_client
from elastic.live.membership import LiveMembership, LiveSettings, new_worker_id
from elastic.live.protocol import LiveKeys
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules
from service.controller.identities import JobIdentities
from service.core.models import Assignment, JobRecord, JobSpec, JobStatus
from service.core.states import JobState
from service.core.store import ServiceStore, identity_key
from service.core.view import ClusterView, JobEntry, JobUpdate, Plan
from tests.service.tls_etcd import Service as _Service

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates"),
]
_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tls_etcd", [True], indirect=True)
def test_job_runs_with_mutual_tls_to_etcd(tls_etcd: str, certs: Path, tmp_path: Path) -> None:
    flags = [
        "--etcd-ca-cert",
        str(certs / "ca.pem"),
        "--etcd-cert",
        str(certs / "client.pem"),
        "--etcd-key",
        str(certs / "client.key"),
    ]
    service = _Service(tmp_path, tls_etcd, flags)
    try:
        job = service.run_one_node_job()
    finally:
        service.stop()
    assert job["state"] == "succeeded", job["last_error"]
    log = next((tmp_path / "work" / "jobs").glob("*/g1/n1.log")).read_text()
    assert "ca_cert=" in log and "rank 0 of 1" in log


@pytest.mark.parametrize("tls_etcd", [False], indirect=True)
def test_job_runs_with_etcd_user_and_password_and_a_wrong_password_is_refused(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    ctl = ["etcdctl", f"--endpoints=https://{tls_etcd}", "--cacert", str(certs / "ca.pem")]
    env = {**os.environ, "ETCDCTL_API": "3"}
    subprocess.run([*ctl, "user", "add", "root:s3cret-pw"], check=True, capture_output=True, env=env, timeout=30)
    subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True, env=env, timeout=30)
    (tmp_path / "pw").write_text("s3cret-pw\n")
    (tmp_path / "bad").write_text("wrong\n")
    base = ["--etcd-ca-cert", str(certs / "ca.pem"), "--etcd-user", "root"]

    bad = _Service(
        tmp_path,
        tls_etcd,
        [*base, "--etcd-password-file", str(tmp_path / "bad"), "--etcd-connect-timeout", "2"],
    )
    proc = bad.etrain("bad-agent", "agent", "--node-name", "x")
    assert proc.wait(timeout=30) == 2
    lines = (tmp_path / "bad-agent.log").read_text().strip().splitlines()
    assert len(lines) == 1 and "authentication failed" in lines[0]

    service = _Service(tmp_path, tls_etcd, [*base, "--etcd-password-file", str(tmp_path / "pw")])
    try:
        job = service.run_one_node_job()
    finally:
        service.stop()
    assert job["state"] == "succeeded", job["last_error"]
    log = next((tmp_path / "work" / "jobs").glob("*/g1/n1.log")).read_text()
    assert "s3cret-pw" not in log.splitlines()[0]  # the password is not on torchrun's command line


# -- each job's own etcd user --------------------------------------------------------------------------
_ROOT_PW = "s3cret-pw"


def _enable_auth(endpoint: str, certs: Path) -> None:
    """``root`` with a password, then etcd auth on (as an operator would)."""
    ctl = ["etcdctl", f"--endpoints=https://{endpoint}", "--cacert", str(certs / "ca.pem")]
    env = {**os.environ, "ETCDCTL_API": "3"}
    subprocess.run([*ctl, "user", "add", f"root:{_ROOT_PW}"], check=True, capture_output=True, env=env, timeout=30)
    subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True, env=env, timeout=30)


def _client(endpoint: str, certs: Path, user: str, password: str) -> GrpcEtcdClient:
    options = {"ca_cert": str(certs / "ca.pem"), "user": user, "password": password, "op_timeout": "5"}
    return create_client(EtcdConfig.from_options(endpoint, options))


def _pass(**states: JobState) -> tuple[ClusterView, Plan]:
    """A view of these jobs (id -> state) and a plan that assigns node n1 to each one not terminal."""
    now = datetime.now(timezone.utc)
    spec = JobSpec(name="j", entrypoint="t.py")
    view = ClusterView(
        jobs={
            j: JobEntry(
                JobRecord(id=j, spec=spec, created_at=now), JobStatus(state=st, created_at=now, updated_at=now), 1
            )
            for j, st in states.items()
        },
        nodes={},
        assignments={},
    )
    plan = Plan(
        updates=[
            JobUpdate(j, 1, None, assign={"n1": Assignment(job_id=j, generation=1, spec=spec, assigned_at=now)})
            for j, st in states.items()
            if not st.terminal
        ]
    )
    return view, plan


@pytest.mark.parametrize("tls_etcd", [False], indirect=True)
def test_a_jobs_etcd_user_reaches_its_own_rendezvous_and_progress_but_nothing_of_the_control_plane(
    tls_etcd: str, certs: Path
) -> None:
    _enable_auth(tls_etcd, certs)
    root = _client(tls_etcd, certs, "root", _ROOT_PW)
    store = ServiceStore(root, "/etrain")
    keys = store.keys
    root.put(keys.leader, b"me")
    leader, _ = root.get(keys.leader)
    assert leader is not None
    fence = (keys.leader, leader.create_revision)
    identities = JobIdentities(store)
    view, plan = _pass(**{"job-a1": JobState.PENDING, "job-b2": JobState.PENDING})
    creds = {}
    for update in identities.prepare(view, plan, fence, datetime.now(timezone.utc)).updates:
        a = update.assign["n1"]
        assert a.etcd_user is not None and a.etcd_password is not None
        creds[a.job_id] = (a.etcd_user, a.etcd_password)
    job = _client(tls_etcd, certs, *creds["job-a1"])
    try:
        # allowed: the reachability check, its rendezvous (any generation) with leases and watches, its progress
        job.ping()
        state = f"{keys.rdzv}/job-a1.g1/rdzv/state"
        lease = job.grant_lease(timedelta(seconds=10))
        ok, _, _, _ = job.compare_and_put(
            state, b"s", mod_revision=0, lease=lease, read_prefix=f"{keys.rdzv}/job-a1.g1/rdzv/alive/"
        )
        assert ok and job.keep_alive_once(lease) > 0
        revision = job.put(f"{keys.rdzv}/job-a1.g7/store/k", b"v")
        assert job.wait_for_event(f"{keys.rdzv}/job-a1.g7/", revision, timedelta(seconds=5), prefix=True)
        assert job.get_with_prefix(state, f"{keys.rdzv}/job-a1.g1/")[0] is not None
        job.revoke_lease(lease)
        assert job.get(state)[0] is None
        # the rendezvous itself, as torchrun runs it with the job's credentials (range compares included)
        settings = HandlerSettings(rules=RoundRules(1, 1, timedelta(seconds=1)))
        handler = EtcdV3RendezvousHandler(job, "job-a1.g3", RendezvousKeys.of(keys.rdzv, "job-a1.g3"), settings)
        try:
            assert handler.next_rendezvous().world_size == 1
        finally:
            handler.release()
        # live recovery (recovery: live): the workers' own group under <key_prefix>/<run id>/live/, with the
        # job's credentials (ETRAIN_ETCD_*): registration on a lease, the generation's transaction, its end
        live_keys = LiveKeys(RendezvousKeys.of(keys.rdzv, "job-a1.g3").live)
        live = LiveSettings(1, 1, last_call=timedelta(seconds=0.1), join_timeout=timedelta(seconds=20))
        member = LiveMembership(job, live_keys, new_worker_id("n1", 0), live, node="n1")
        try:
            assert member.join().members == (member.wid,)
            member.finish()
        finally:
            member.close()
        job.put(keys.progress_of("job-a1"), b'{"step": 1, "world_size": 1, "time": 0}')
        assert job.get(keys.progress_of("job-a1"))[0] is not None
        # refused: the control plane's keys and the other job's
        refused = [
            lambda: job.put(keys.assignment("n1", "job-a1"), b"{}"),
            lambda: job.put(keys.progress_of("job-b2"), b"{}"),
            lambda: job.put(keys.status_of("job-a1"), b"{}"),
            lambda: job.put(keys.leader, b"me"),
            lambda: job.delete(keys.leader),
            lambda: job.get_prefix(keys.jobs),
            lambda: job.get(keys.assignment("n1", "job-a1")),
            lambda: job.get(identity_key(keys, "job-a1")),
            lambda: job.put(f"{keys.rdzv}/job-b2.g1/rdzv/state", b"x"),
            lambda: job.get_prefix(keys.rdzv + "/"),
        ]
        for i, attempt in enumerate(refused):
            with pytest.raises(EtcdError, match="permission denied"):
                attempt()
                pytest.fail(f"attempt {i} was allowed")
        # the job ends: its user goes, and with it the job's access
        view, plan = _pass(**{"job-a1": JobState.SUCCEEDED, "job-b2": JobState.RUNNING})
        identities.prepare(view, plan, fence, datetime.now(timezone.utc))
        assert "etrain-job-job-a1" not in root.user_list() and "etrain-job-job-b2" in root.user_list()
        with pytest.raises(EtcdError):
            job.put(keys.progress_of("job-a1"), b"{}")
    finally:
        job.close()
        root.close()


_DUMP_ENV = """
import json, os, sys
from elastic.contract.env import WorkerEnv
from elastic.etcd import EtcdError, create_client
from elastic.train.progress import create_reporter
worker = WorkerEnv.from_environ()
client = create_client(worker.etcd.config())
try:
    client.get_prefix(worker.job.progress_key.rsplit("/progress/", 1)[0] + "/jobs/")
    jobs = "read"
except EtcdError as exc:
    jobs = str(exc)
reporter = create_reporter()
reporter.report(7, world_size=1, total_steps=7, force=True)
reporter.close()
with open(sys.argv[1], "w") as fh:
    json.dump({"env": dict(os.environ), "jobs": jobs}, fh)
"""


@pytest.mark.parametrize("tls_etcd", [False], indirect=True)
def test_a_job_runs_as_its_own_etcd_user_without_the_control_planes_credentials_and_the_user_goes_after(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    _enable_auth(tls_etcd, certs)
    (tmp_path / "pw").write_text(_ROOT_PW + "\n")
    flags = [
        "--etcd-ca-cert",
        str(certs / "ca.pem"),
        "--etcd-user",
        "root",
        "--etcd-password-file",
        str(tmp_path / "pw"),
    ]
    service = _Service(tmp_path, tls_etcd, flags)
    dump = tmp_path / "worker-env.json"
    try:
        job = service.run_one_node_job(_DUMP_ENV.replace("sys.argv[1]", repr(str(dump))))
    finally:
        service.stop()
    assert job["state"] == "succeeded", job["last_error"]
    progress = job["progress"]
    assert isinstance(progress, dict) and progress["step"] == 7  # reported under the job's own user
    seen = json.loads(dump.read_text())
    env: dict[str, str] = seen["env"]
    user = f"etrain-job-{job['id']}"
    assert env["ETRAIN_ETCD_USER"] == user
    secret = Path(env["ETRAIN_ETCD_PASSWORD_FILE"])
    assert secret.parent.parent.name == job["id"] and not secret.exists()  # deleted when the job left the node
    assert {k: v for k, v in env.items() if _ROOT_PW in v or str(tmp_path / "pw") in v} == {}
    assert "root" not in [v for k, v in env.items() if k.startswith("ETRAIN_ETCD")]
    assert "user=root" not in env.get("PET_RDZV_CONF", "")
    assert "permission denied" in seen["jobs"]  # the job cannot read the control plane's jobs/
    command = next((tmp_path / "work" / "jobs").glob("*/g1/n1.log")).read_text().splitlines()[0]
    assert f"user={user}" in command and "user=root" not in command and _ROOT_PW not in command
    root = _client(tls_etcd, certs, "root", _ROOT_PW)
    try:
        assert not [u for u in root.user_list() if u.startswith("etrain-job-")]
    finally:
        root.close()


_PROBE = """
import json, os, sys, traceback
def attempt(path):
    try:
        open(path).read()
        return "read"
    except PermissionError:
        return "PermissionError"
try:
    from elastic.train.progress import create_reporter
    reporter = create_reporter()
    reporter.report(7, world_size=1, total_steps=7, force=True)
    reporter.close()
    files = {k: os.environ[k] for k in ("ETRAIN_ETCD_CA_CERT", "ETRAIN_ETCD_PASSWORD_FILE")}
    seen = {"uid": os.getuid(), "agent_password_file": attempt(AGENT_PW), "files": files,
            "own": {k: attempt(v) for k, v in files.items()}}
except Exception:
    seen = {"error": traceback.format_exc()}
with open(DUMP, "w") as fh:
    json.dump(seen, fh)
"""


def _job_python() -> str:
    for candidate in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        real = Path(candidate).resolve()
        if real.exists() and all(p.stat().st_mode & 0o001 for p in real.parents):
            return candidate
    pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that other uids may run")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching jobs' uids needs root")
@pytest.mark.parametrize("tls_etcd", [False], indirect=True)
def test_a_job_on_a_uid_of_its_own_reaches_etcd_with_its_own_files_and_cannot_read_the_agents_password_file(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    _enable_auth(tls_etcd, certs)
    shared = Path(tempfile.mkdtemp(prefix="etrain-uid-etcd-"))  # every uid may enter it (pytest's are root's)
    try:
        shared.chmod(0o777)
        password_file = shared / "agent-pw"  # the agent's own etcd password, 0600 as it must be: refused otherwise
        password_file.write_text(_ROOT_PW + "\n")
        password_file.chmod(0o600)
        flags = [
            "--etcd-ca-cert",
            str(certs / "ca.pem"),
            "--etcd-user",
            "root",
            "--etcd-password-file",
            str(password_file),
        ]
        service = _Service(tmp_path, tls_etcd, flags)
        dump = shared / "worker.json"
        script = f"DUMP, AGENT_PW = {str(dump)!r}, {str(password_file)!r}\n" + _PROBE
        python = _job_python()  # the jobs' uids must be able to run it, with this environment's packages
        path = os.pathsep.join((str(_ROOT), sysconfig.get_paths()["purelib"]))
        try:
            job = service.run_one_node_job(
                script,
                agent_args=("--job-uid-range", "23100-23199", "--python", python),
                where=shared,
                env={"PYTHONPATH": path},
            )
        finally:
            service.stop()
        seen = json.loads(dump.read_text())
        assert "error" not in seen, seen.get("error")
        assert job["state"] == "succeeded", job["last_error"]  # its rendezvous: TLS with its own CA copy, its user
        progress = job["progress"]
        assert isinstance(progress, dict) and progress["step"] == 7  # reported under its own etcd user
        assert 23100 <= seen["uid"] <= 23199
        assert seen["agent_password_file"] == "PermissionError"
        private = shared / "work" / "jobs" / str(job["id"]) / "private"
        assert seen["files"] == {
            "ETRAIN_ETCD_CA_CERT": str(private / "etcd-ca.pem"),
            "ETRAIN_ETCD_PASSWORD_FILE": str(private / "etcd-password"),
        }
        assert seen["own"] == {"ETRAIN_ETCD_CA_CERT": "read", "ETRAIN_ETCD_PASSWORD_FILE": "read"}
        assert not private.exists()  # deleted when the job left the node
    finally:
        shutil.rmtree(shared)
