"""Jobs on one node run as uids of their own: a job cannot read another's secrets, environment or the agent's.

Real etcd, controller and one agent (``etrain agent --job-uid-range``, as root), stock torchrun: two jobs share the
node. The victim job's worker records where its secrets are and waits; the attacker job's worker tries to read
them (its private directory, its checkpoint key file, ``/proc/<pid>/environ`` of the victim's worker) and the
agent's own (its ``/proc/<pid>/environ``, a root-only 0400 file as the chart mounts its secrets), and records
what each attempt raised.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.testing.cluster import REPO, LocalServiceCluster
from tests.integration.service_harness import wait_api

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching jobs' uids needs root"),
]

UIDS = (23000, 23099)

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    out, role = Path(sys.argv[1]), sys.argv[2]
    key_file = os.environ.get("ETRAIN_CHECKPOINT_KEY_FILE")
    me = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "pid": os.getpid(),
          "key_in_env": "ETRAIN_CHECKPOINT_KEY" in os.environ, "key_file": key_file,
          "own_key_hex": len(Path(key_file).read_text().strip()) if key_file else 0,
          "home": os.environ.get("HOME"), "user": os.environ.get("USER")}

    def attempt(how, path):
        try:
            how(path)
            return "read"
        except PermissionError:
            return "PermissionError"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def read(path):
        with open(path, "rb") as fh:
            fh.read(64)

    def publish(name, data):
        tmp = out / f".{name}.tmp"
        tmp.write_text(json.dumps(data))
        tmp.rename(out / name)

    if role == "victim":
        publish("victim.json", me)
        while not (out / "done").exists():
            time.sleep(0.1)
    else:
        victim = json.loads((out / "victim.json").read_text())
        agent_pid, agent_secret = sys.argv[3], sys.argv[4]
        me["victim_uid"] = victim["uid"]
        me["tries"] = {
            "other_key_file": attempt(read, victim["key_file"]),
            "other_private_dir": attempt(os.listdir, str(Path(victim["key_file"]).parent)),
            "other_environ": attempt(read, f"/proc/{victim['pid']}/environ"),
            "agent_environ": attempt(read, f"/proc/{agent_pid}/environ"),
            "agent_secret": attempt(read, agent_secret),
        }
        publish("attacker.json", me)
    """
)


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A directory every uid may use (pytest's own temporary directories are root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="etrain-uids-"))
    d.chmod(0o777)
    (d / "probe.py").write_text(PROBE)
    (d / "probe.py").chmod(0o644)
    yield d
    shutil.rmtree(d)


def _job_python() -> str:
    """An interpreter every uid may run (this one may live under a root-only directory, as pyenv's under /root);
    the jobs get this environment's packages through PYTHONPATH (:func:`_spec`)."""
    for candidate in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        real = Path(candidate).resolve()
        if real.exists() and all(p.stat().st_mode & 0o001 for p in real.parents):
            return candidate
    pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that other uids may run")


def _spec(name: str, shared: Path, *args: str, warm: bool) -> dict[str, Any]:
    path = os.pathsep.join((str(REPO), sysconfig.get_paths()["purelib"]))
    return {
        "name": name,
        "entrypoint": str(shared / "probe.py"),
        "args": [str(shared), *args],
        "working_dir": str(shared),
        "warm_start": warm,
        "rendezvous": {"last_call_timeout": 1},
        "env": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        "restart_policy": {"max_failures": 0, "max_worker_restarts": 0},
    }


def _published(api: Any, job_id: str, path: Path, timeout: float) -> None:
    """Wait for the job's worker to publish ``path``; a job that ended first fails the test at once, with why."""
    ended = ("succeeded", "failed", "cancelled")
    wait_api(f"{path.name} from job {job_id}", lambda: path.exists() or api.job(job_id)["state"] in ended, timeout)
    if not path.exists():
        job = api.job(job_id)
        raise AssertionError(
            f"job {job_id} ended {job['state']} before its worker wrote {path.name}: "
            f"{job['message']!r}, {job['last_error']!r}, events {api.events(job_id)}"
        )


def test_two_jobs_on_one_agent_run_as_distinct_uids_and_cannot_read_each_others_or_the_agents_secrets(
    tmp_path: Path, shared: Path
) -> None:
    cluster = LocalServiceCluster(tmp_path / "svc")
    # a file as the chart mounts the agent's secrets (its etcd client key, its etcd password: root's, 0400), in a
    # directory every uid may enter: only its mode keeps the jobs out (this etcd has no TLS or auth to give the
    # agent a real one; the agent's refusal of readable ones is tests/service/agent/test_isolation.py)
    agent_secret = shared / "agent-client.key"
    agent_secret.write_text("agent-only\n")
    agent_secret.chmod(0o400)
    try:
        api = cluster.start_controller()
        work = shared / "agent-work"  # a work dir the jobs' uids can reach their private directories in
        flags = ["--job-uid-range", f"{UIDS[0]}-{UIDS[1]}", "--work-dir", str(work), "--python", _job_python()]
        cluster.start_agent("n1", nproc_per_node=2, extra_args=flags)
        wait_api("the agent", lambda: [n for n in api.nodes() if n["name"] == "n1"], 60)
        assert next(n for n in api.nodes() if n["name"] == "n1")["isolation"] == "uid"
        victim = api.submit(_spec("victim", shared, "victim", warm=False))["id"]
        _published(api, victim, shared / "victim.json", 90)
        agent_pid = str(cluster.agents["n1"].pid)
        attacker = api.submit(_spec("attacker", shared, "attacker", agent_pid, str(agent_secret), warm=True))["id"]
        # its zygote (torch imported as the attacker's uid) starts first: on a loaded machine (a parallel suite),
        # over 90 s once
        _published(api, attacker, shared / "attacker.json", 180)
        private = work / "jobs" / victim / "private"
        st = private.stat()
        key = (private / "checkpoint-key").stat()
        (shared / "done").write_text("")
        for job in (victim, attacker):
            wait_api(f"{job} to succeed", lambda job=job: api.job(job)["state"] == "succeeded", 60)
        wait_api("the victim's private directory to go", lambda: not private.exists(), 30)
    finally:
        cluster.stop()
    v = json.loads((shared / "victim.json").read_text())
    a = json.loads((shared / "attacker.json").read_text())
    for who in (v, a):
        assert UIDS[0] <= who["uid"] <= UIDS[1] and who["gid"] == who["uid"], who
        assert who["groups"] in ([], [who["gid"]]), who  # no supplementary group of the agent's
        assert not who["key_in_env"] and who["own_key_hex"] == 64, who  # its key: in its own file only
        assert who["home"].endswith("/private") and who["user"] != "root", who
    assert a["uid"] != v["uid"] == a["victim_uid"]
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, v["uid"])
    assert (stat.S_IMODE(key.st_mode), key.st_uid) == (0o600, v["uid"])
    assert a["tries"] == {
        "other_key_file": "PermissionError",
        "other_private_dir": "PermissionError",
        "other_environ": "PermissionError",
        "agent_environ": "PermissionError",
        "agent_secret": "PermissionError",
    }
