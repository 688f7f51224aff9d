"""The torchrun command and environment (pure), and stopping real process trees with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.contract.env import LIVE_PREFIX, WorkerEnv
from elastic.contract.lr import LRPolicy, LRRule
from elastic.etcd import MemoryEtcdClient
from elastic.proctree import alive, process_stat
from elastic.rendezvous.plugin import live_worker_environ, recovery_mode
from elastic.rendezvous.protocol import RendezvousKeys
from service.agent.launcher import (
    JobIdentityError,
    TorchrunProcess,
    descendants,
    job_etcd,
    rdzv_conf,
    torchrun_command,
    worker_env,
    write_secret,
)
from service.agent.node import NodeAgent
from service.core.config import AgentSettings, EtcdOptions
from service.core.models import Assignment, JobSpec, RecoveryMode, WorkerReport

pytestmark = pytest.mark.timeout(60)


def _assignment(**spec: object) -> Assignment:
    base: dict[str, object] = {"name": "j", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 3}
    base.update(spec)
    return Assignment(
        job_id="j-abc",
        generation=4,
        spec=JobSpec.model_validate(base),
        checkpoint_url="file:///ck/j-abc",
        assigned_at=datetime.now(timezone.utc),
    )


def test_torchrun_command_is_stock_torchrun_with_the_etcd_v3_rendezvous() -> None:
    a = _assignment(args=["--steps", "5"], nproc_per_node=2, restart_policy={"max_worker_restarts": 7})
    cmd = torchrun_command(
        a,
        python="py",
        etcd_endpoints="127.0.0.1:1,127.0.0.1:2",
        rdzv_host="127.0.0.1",
        conf_on_command_line="key_prefix=/p/rdzv",
    )
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert {
        "--nnodes=2:3",
        "--nproc-per-node=2",
        "--rdzv-backend=etcd-v3",
        "--rdzv-endpoint=127.0.0.1:1,127.0.0.1:2",
        "--rdzv-id=j-abc-g4",
        "--max-restarts=7",
        "--rdzv-conf=key_prefix=/p/rdzv",
        "--local-addr=127.0.0.1",
    } <= set(cmd)
    # warm starts by default: torchrun runs elastic.prefork clients, the node's zygote forks the script
    assert cmd[-5:] == ["--module", "elastic.prefork", "train.py", "--steps", "5"]
    module = torchrun_command(
        _assignment(module=True), python="py", etcd_endpoints="e:1", rdzv_host=None, conf_on_command_line=None
    )
    assert module[-4:] == ["--module", "elastic.prefork", "-m", "train.py"]
    assert not any(c.startswith(("--rdzv-conf", "--local-addr")) for c in module)
    cold = torchrun_command(
        _assignment(module=True, warm_start=False),
        python="py",
        etcd_endpoints="e:1",
        rdzv_host=None,
        conf_on_command_line=None,
    )
    assert cold[-2:] == ["--module", "train.py"] and "elastic.prefork" not in cold
    cold_script = torchrun_command(
        _assignment(warm_start=False), python="py", etcd_endpoints="e:1", rdzv_host=None, conf_on_command_line=None
    )
    assert cold_script[-1] == "train.py" and "--module" not in cold_script


def test_rdzv_conf_carries_timeouts_prefix_tls_and_a_users_password_file_but_never_a_password(
    tmp_path: Path,
) -> None:
    a = _assignment(rendezvous={"last_call_timeout": 1, "join_timeout": 30, "node_ttl": 2})
    plain = rdzv_conf(a, EtcdOptions("e:1"), "/etrain/rdzv")
    assert plain == "key_prefix=/etrain/rdzv,last_call_timeout=1,join_timeout=30,node_ttl=2,connect_timeout=5"
    tls = EtcdOptions(
        "e:1", ca_cert="ca.pem", cert="c.pem", cert_key="k.pem", user="u", password_file="pw", password="s3cret"
    )
    text = rdzv_conf(a, tls, "/p")
    conf = dict(kv.split("=", 1) for kv in text.split(","))
    assert conf["ca_cert"] == str(Path("ca.pem").resolve()) and conf["cert_key"] == str(Path("k.pem").resolve())
    assert (conf["user"], conf["password_file"]) == ("u", str(Path("pw").resolve()))
    assert "password" not in conf and "s3cret" not in text


def test_the_spec_recovery_field_defaults_to_restart_and_refuses_other_modes() -> None:
    assert _assignment().spec.recovery is RecoveryMode.RESTART
    live = _assignment(recovery="live").spec
    assert live.recovery is RecoveryMode.LIVE and live.recovery == "live"
    assert JobSpec.model_validate_json(live.model_dump_json()) == live  # stored and read back (etcd, assignments)
    assert '"recovery":"live"' in live.model_dump_json()
    with pytest.raises(ValidationError, match="recovery"):
        _assignment(recovery="inplace")
    assert "'live'" in (JobSpec.model_fields["recovery"].description or "")


def test_rdzv_conf_asks_torchrun_for_live_recovery_only_when_the_spec_does() -> None:
    restart = rdzv_conf(_assignment(recovery="restart"), EtcdOptions("e:1"), "/etrain.rdzv")
    assert "recovery" not in restart  # the stock rendezvous, as before the field existed
    live = rdzv_conf(_assignment(recovery="live"), EtcdOptions("e:1"), "/etrain.rdzv")
    conf = dict(kv.split("=", 1) for kv in live.split(","))
    assert conf["recovery"] == "live" and conf["key_prefix"] == "/etrain.rdzv"
    # what torchrun's etcd-v3 plugin makes of it: the workers' live group under the generation's run
    a = _assignment(recovery="live")
    params = RendezvousParameters("etcd-v3", "e:1", a.rdzv_id, 2, 3, **conf)
    assert recovery_mode(params) == "live"
    # the service sets ETRAIN_ETCD_ENDPOINTS (the job's own connection): the plugin keeps it
    exported = live_worker_environ(
        params, RendezvousKeys.of(conf["key_prefix"], a.rdzv_id), {"ETRAIN_ETCD_ENDPOINTS": "e:1"}
    )
    assert exported[LIVE_PREFIX] == "/etrain.rdzv/j-abc-g4/live/" and "ETRAIN_ETCD_ENDPOINTS" not in exported


# -- the job's own etcd identity ---------------------------------------------------------------------
_AGENT_ETCD = EtcdOptions(
    "e:1", ca_cert="ca.pem", cert="c.pem", cert_key="k.pem", user="root", password_file="/secrets/root-pw"
)


def _with_identity(a: Assignment) -> Assignment:
    return a.model_copy(update={"etcd_user": "etrain-job-j-abc", "etcd_password": "job-pw"})


def test_job_etcd_gives_the_job_its_own_user_and_password_file_and_keeps_only_the_agents_tls_files(
    tmp_path: Path,
) -> None:
    etcd = job_etcd(_AGENT_ETCD, _with_identity(_assignment()), tmp_path / "pw")
    assert (etcd.user, etcd.password_file, etcd.password) == ("etrain-job-j-abc", str(tmp_path / "pw"), None)
    assert (etcd.endpoints, etcd.ca_cert, etcd.cert, etcd.cert_key) == ("e:1", "ca.pem", "c.pem", "k.pem")
    env = worker_env(
        _assignment(),
        base={"ETRAIN_ETCD_PASSWORD_FILE": "/secrets/root-pw"},
        node_name="n1",
        progress_key="/p",
        etcd=etcd,
    )
    assert (env["ETRAIN_ETCD_USER"], env["ETRAIN_ETCD_PASSWORD_FILE"]) == ("etrain-job-j-abc", str(tmp_path / "pw"))
    assert "root" not in env.values() and "/secrets/root-pw" not in env.values()


def test_job_etcd_refuses_to_hand_a_job_the_agents_etcd_user_when_the_assignment_has_none() -> None:
    with pytest.raises(JobIdentityError, match="refusing to hand it to the job"):
        job_etcd(_AGENT_ETCD, _assignment(), None)
    with pytest.raises(JobIdentityError, match="no password file"):
        job_etcd(_AGENT_ETCD, _with_identity(_assignment()), None)


def test_job_etcd_without_etcd_auth_shares_the_agents_connection_without_any_password() -> None:
    certs_only = EtcdOptions("e:1", ca_cert="ca.pem", cert="c.pem", cert_key="k.pem", password_file="stale")
    etcd = job_etcd(certs_only, _assignment(), None)
    assert etcd == EtcdOptions("e:1", ca_cert="ca.pem", cert="c.pem", cert_key="k.pem")


def test_write_secret_makes_a_file_only_its_owner_reads_even_over_a_looser_one(tmp_path: Path) -> None:
    path = tmp_path / "jobs" / "j" / "etcd-password"
    path.parent.mkdir(parents=True)
    path.write_text("old")
    path.chmod(0o644)
    write_secret(path, "new-pw")
    assert path.read_text() == "new-pw\n" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["etcd-password"]


class _Proc:
    pid = 4242

    def poll(self) -> int | None:
        return None

    def stop(self, grace: timedelta) -> int:
        return -15

    def tail(self) -> str:
        return ""


def _agent(tmp_path: Path, etcd: EtcdOptions) -> tuple[NodeAgent, list[tuple[list[str], dict[str, str]]]]:
    launched: list[tuple[list[str], dict[str, str]]] = []

    def launcher(cmd: Sequence[str], env: Mapping[str, str], cwd: str, log: Path) -> _Proc:
        launched.append((list(cmd), dict(env)))
        return _Proc()

    settings = AgentSettings(etcd=etcd, node_name="n1", work_dir=tmp_path / "work", python="py")
    return NodeAgent(settings, MemoryEtcdClient(), launcher=launcher), launched


def test_the_agent_gives_torchrun_and_workers_the_jobs_etcd_user_and_a_0600_password_file_never_its_own(
    tmp_path: Path,
) -> None:
    (tmp_path / "root-pw").write_text("control-plane-pw\n")
    etcd = EtcdOptions("e:1", ca_cert="ca.pem", user="root", password_file=str(tmp_path / "root-pw"))
    agent, launched = _agent(tmp_path, etcd)
    agent.sync({"j-abc": _with_identity(_assignment())})
    [(cmd, env)] = launched
    secret = (tmp_path / "work" / "jobs" / "j-abc" / "private" / "etcd-password").resolve()
    assert secret.read_text() == "job-pw\n" and secret.stat().st_mode & 0o777 == 0o600
    assert secret.parent.stat().st_mode & 0o777 == 0o700
    conf = dict(kv.split("=", 1) for kv in next(c for c in cmd if c.startswith("--rdzv-conf="))[12:].split(","))
    assert (conf["user"], conf["password_file"]) == ("etrain-job-j-abc", str(secret))
    assert (env["ETRAIN_ETCD_USER"], env["ETRAIN_ETCD_PASSWORD_FILE"]) == ("etrain-job-j-abc", str(secret))
    everything = " ".join(cmd) + " ".join(f"{k}={v}" for k, v in env.items())
    assert "control-plane-pw" not in everything and "job-pw" not in everything
    assert str(tmp_path / "root-pw") not in everything and "user=root" not in everything
    agent.sync({})  # unassigned: torchrun stopped, the private directory deleted
    assert not secret.exists() and not secret.parent.exists()


def test_the_agent_gives_workers_their_checkpoint_key_in_a_0600_file_never_in_the_environment(
    tmp_path: Path,
) -> None:
    agent, launched = _agent(tmp_path, EtcdOptions("e:1"))
    agent.sync({"j-abc": _assignment().model_copy(update={"checkpoint_key": "cd" * 32})})
    [(cmd, env)] = launched
    key = (tmp_path / "work" / "jobs" / "j-abc" / "private" / "checkpoint-key").resolve()
    assert "ETRAIN_CHECKPOINT_KEY" not in env and env["ETRAIN_CHECKPOINT_KEY_FILE"] == str(key)
    assert key.stat().st_mode & 0o777 == 0o600
    assert WorkerEnv.from_environ(env).checkpoint_key == bytes.fromhex("cd" * 32)  # what the workers read
    assert "cd" * 32 not in " ".join(cmd) + " ".join(env.values())
    agent.sync({})
    assert not key.exists()


def test_an_agent_with_an_etcd_user_refuses_to_launch_a_job_that_has_no_identity_of_its_own(
    tmp_path: Path,
) -> None:
    (tmp_path / "root-pw").write_text("control-plane-pw\n")
    etcd = EtcdOptions("e:1", ca_cert="ca.pem", user="root", password_file=str(tmp_path / "root-pw"))
    agent, launched = _agent(tmp_path, etcd)
    agent.sync({"j-abc": _assignment()})
    assert launched == []
    kv, _ = agent.client.get(agent.store.keys.report("j-abc", "n1"))
    assert kv is not None
    report = WorkerReport.model_validate_json(kv.value)
    assert report.state == "launch_failed" and "refusing to hand it to the job" in (report.error or "")


def test_worker_env_sets_service_variables_over_user_and_base_values() -> None:
    a = _assignment(env={"FOO": "1"}, lr_policy={"scaling": "sqrt", "base_lr": 0.5})
    env = worker_env(
        a,
        base={"PATH": "/bin", "ETRAIN_CHECKPOINT_URL": "stale", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
        node_name="n1",
        progress_key="/etrain/progress/j-abc",
        etcd=EtcdOptions("127.0.0.1:9"),
        extra={"BAR": "2"},
    )
    assert env["PATH"] == "/bin" and env["FOO"] == "1" and env["BAR"] == "2"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["ETRAIN_CHECKPOINT_URL"] == "file:///ck/j-abc"
    assert (env["ETRAIN_JOB_ID"], env["ETRAIN_GENERATION"], env["ETRAIN_NODE_NAME"]) == ("j-abc", "4", "n1")
    assert env["ETRAIN_PROGRESS_KEY"] == "/etrain/progress/j-abc"
    assert env["ETRAIN_ETCD_ENDPOINTS"] == "127.0.0.1:9"
    job = WorkerEnv.from_environ(env).job  # the workers' one parser reads back the spec's policy
    assert job is not None and job.lr_policy == LRPolicy(LRRule.SQRT, 0.5, 1, 32)
    assert (job.min_nodes, job.max_nodes, job.job_name) == (2, 3, "j")
    assert env["ETRAIN_LOCAL_SNAPSHOT_EVERY"] == "0"  # off unless the spec asks
    assert "ETRAIN_CHECKPOINT_KEY" not in env  # an assignment without a key (made before keys existed)
    keyed = worker_env(
        a.model_copy(update={"checkpoint_key": "ab" * 32}),
        base={},
        node_name="n1",
        progress_key="/p",
        etcd=EtcdOptions("e:1"),
    )
    assert WorkerEnv.from_environ(keyed).checkpoint_key == bytes.fromhex("ab" * 32)


def test_worker_env_drops_inherited_service_variables_it_does_not_set(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    a = _assignment()
    base = {"ETRAIN_ETCD_USER": "old", "ETRAIN_ETCD_PASSWORD_FILE": "/old/pw", "ETRAIN_PREFORK": "0"}
    env = worker_env(a, base=base, node_name="n1", progress_key="/p", etcd=EtcdOptions("e:1"))
    assert "ETRAIN_ETCD_USER" not in env and "ETRAIN_ETCD_PASSWORD_FILE" not in env
    assert env["ETRAIN_PREFORK"] == "0"  # the library's own settings pass through
    etcd = EtcdOptions("e:1", user="u", password_file=str(pw), cert_key="k.pem", cert="c.pem", ca_cert="ca.pem")
    env = worker_env(a, base=base, node_name="n1", progress_key="/p", etcd=etcd)
    assert (env["ETRAIN_ETCD_USER"], env["ETRAIN_ETCD_PASSWORD_FILE"]) == ("u", str(pw))
    assert env["ETRAIN_ETCD_KEY"] == str(Path("k.pem").resolve())  # workers run in another directory


def test_local_snapshot_every_reaches_the_workers_and_a_negative_one_is_refused() -> None:
    env = worker_env(
        _assignment(local_snapshot_every=2),
        base={"ETRAIN_LOCAL_SNAPSHOT_EVERY": "9"},
        node_name="n1",
        progress_key="/p",
        etcd=EtcdOptions("e:1"),
    )
    assert env["ETRAIN_LOCAL_SNAPSHOT_EVERY"] == "2"
    with pytest.raises(ValueError, match="local_snapshot_every"):
        _assignment(local_snapshot_every=-1)


def test_the_nodes_socket_ifname_binds_gloo_and_nccl_unless_the_job_sets_its_own() -> None:
    def env_of(a: Assignment, ifname: str | None) -> dict[str, str]:
        base = {"GLOO_SOCKET_IFNAME": "eth9"}
        etcd = EtcdOptions("e:1")
        return worker_env(a, base=base, node_name="n1", progress_key="/p", etcd=etcd, socket_ifname=ifname)

    env = env_of(_assignment(), "etrain-eth0")
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("etrain-eth0", "etrain-eth0")
    env = env_of(_assignment(env={"GLOO_SOCKET_IFNAME": "lo"}), "etrain-eth0")
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "etrain-eth0")
    env = env_of(_assignment(), None)
    assert env["GLOO_SOCKET_IFNAME"] == "eth9" and "NCCL_SOCKET_IFNAME" not in env


_TREE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    mode = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    st = process_stat(pid)
    return st is not None and alive(pid, st[1])


@pytest.mark.parametrize("mode", ["exit", "ignore"])
def test_stop_ends_the_whole_tree_even_children_in_other_sessions(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    log = tmp_path / "log.txt"
    proc = TorchrunProcess.start([sys.executable, str(script), mode], dict(os.environ), str(tmp_path), log)
    deadline = time.monotonic() + 20
    while len(descendants(proc.pid)) < 1 or not log.read_text().strip().splitlines()[1:]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(log.read_text().strip().splitlines()[-1])
    assert child in [p for p, _ in descendants(proc.pid)]
    started = time.monotonic()
    code = proc.stop(timedelta(seconds=1))
    assert code == (-signal.SIGKILL if mode == "ignore" else -signal.SIGTERM)
    assert not _alive(proc.pid) and not _alive(child)
    assert time.monotonic() - started < 8
    assert "+ " in proc.tail() and str(child) in proc.tail()


_FAKE_AGENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from service.agent.launcher import TorchrunProcess
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    p = TorchrunProcess.start(cmd, {}, ".", Path(sys.argv[1]))
    print(p.pid, flush=True)
    time.sleep(120)
    """
)


def test_workers_get_sigterm_when_their_agent_is_sigkilled(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    agent = subprocess.Popen(
        [sys.executable, "-c", _FAKE_AGENT, str(tmp_path / "w.log")],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    assert _alive(worker)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 10
    while _alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its agent"
        time.sleep(0.05)
