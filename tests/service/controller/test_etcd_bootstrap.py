"""``etrain etcd-bootstrap`` on a real etcd (TLS, no users yet): root and the agents' user made, auth turned on,
the agents' user confined to the service's keys, idempotent, and the service then runs a job with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.etcd import EtcdConfig, EtcdError, GrpcEtcdClient, create_client
from service.controller.etcd_bootstrap import (
    AGENT_ROLE,
    AuthBootstrap,
    BootstrapError,
    BootstrapOutcome,
    agent_permissions,
    bootstrap_etcd_auth,
    node_permissions,
    node_principal,
)
from tests.service.tls_etcd import Service

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates"),
    pytest.mark.parametrize("tls_etcd", [False], indirect=True),
]
_ROOT = Path(__file__).resolve().parents[3]
PLAN = AuthBootstrap(root_password="r00t-pw", agent_user="etrain-agent", agent_password="ag3nt-pw", prefix="/etrain")


def _config(endpoint: str, certs: Path, user: str | None = None, password: str | None = None) -> EtcdConfig:
    options = {"ca_cert": str(certs / "ca.pem"), "op_timeout": "5", "user": user, "password": password}
    return EtcdConfig.from_options(endpoint, options)


def _client(endpoint: str, certs: Path, user: str | None = None, password: str | None = None) -> GrpcEtcdClient:
    return create_client(_config(endpoint, certs, user, password))


def test_bootstrap_turns_auth_on_and_the_agents_user_reaches_the_service_keys_but_manages_no_users(
    tls_etcd: str, certs: Path
) -> None:
    assert bootstrap_etcd_auth(_config(tls_etcd, certs), PLAN) is BootstrapOutcome.ENABLED
    anonymous = _client(tls_etcd, certs)
    with pytest.raises(EtcdError):
        anonymous.get("/etrain/jobs/x")  # no user: refused now
    anonymous.close()
    agent = _client(tls_etcd, certs, "etrain-agent", "ag3nt-pw")
    try:
        agent.put("/etrain/nodes/n1", b"up")
        agent.put("/etrain.rdzv/job-1.g1/state", b"s")
        assert agent.get("/etrain/nodes/n1")[0] is not None
        for key in ("/other/key", "/etrain2/x", "/etrainx"):
            with pytest.raises(EtcdError, match="permission denied"):
                agent.put(key, b"no")
        with pytest.raises(EtcdError):
            agent.user_add("mallory", "pw")
    finally:
        agent.close()
    root = _client(tls_etcd, certs, "root", "r00t-pw")
    try:
        assert sorted(root.user_list()) == ["etrain-agent", "root"]
        expected = sorted(agent_permissions("/etrain"), key=lambda p: (p.key, p.prefix))
        assert root.role_permissions(AGENT_ROLE) == expected
    finally:
        root.close()


def test_bootstrap_again_confirms_and_a_changed_agent_password_takes_effect(tls_etcd: str, certs: Path) -> None:
    bootstrap_etcd_auth(_config(tls_etcd, certs), PLAN)
    rotated = AuthBootstrap(PLAN.root_password, PLAN.agent_user, "n3w-pw", PLAN.prefix)
    assert bootstrap_etcd_auth(_config(tls_etcd, certs), rotated) is BootstrapOutcome.CONFIRMED
    new = _client(tls_etcd, certs, "etrain-agent", "n3w-pw")
    try:
        new.put("/etrain/nodes/n1", b"up")
    finally:
        new.close()
    with pytest.raises(EtcdError, match="authentication failed"):
        old = _client(tls_etcd, certs, "etrain-agent", "ag3nt-pw")
        try:
            old.put("/etrain/nodes/n1", b"up")
        finally:
            old.close()


def test_an_agent_started_before_the_bootstrap_waits_for_etcd_users_and_says_what_it_waited_for(
    tls_etcd: str, certs: Path
) -> None:
    """The chart's agents may start before the controller's init container: a client with a user waits (its
    timeout) for authentication to be turned on, logs in then, and says so plainly when it never is."""
    early = _client(tls_etcd, certs, "etrain-agent", "ag3nt-pw")

    def bootstrap_later() -> BootstrapOutcome:
        time.sleep(1.5)
        return bootstrap_etcd_auth(_config(tls_etcd, certs), PLAN)

    try:
        with pytest.raises(EtcdError, match="has no authentication turned on, but user 'etrain-agent' is configured"):
            early.ping(timeout=timedelta(seconds=1))
        with ThreadPoolExecutor(1) as pool:  # the bootstrap ends (and its outcome is checked) before etcd stops
            bootstrap = pool.submit(bootstrap_later)
            started = time.monotonic()
            early.ping(timeout=timedelta(seconds=30))  # logs in once the bootstrap has turned auth on
            assert 1.0 < time.monotonic() - started < 30
            assert bootstrap.result(timeout=60) is BootstrapOutcome.ENABLED
        early.put("/etrain/nodes/n1", b"up")
    finally:
        early.close()


def test_bootstraps_of_several_controller_replicas_at_once_all_succeed(tls_etcd: str, certs: Path) -> None:
    """Three controller pods' init containers at the same moment: each ends well (one or more turn auth on, the
    others confirm after it), and the users are as one bootstrap leaves them."""
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: bootstrap_etcd_auth(_config(tls_etcd, certs), PLAN), range(3)))
    assert BootstrapOutcome.ENABLED in outcomes and set(outcomes) <= set(BootstrapOutcome), outcomes
    agent = _client(tls_etcd, certs, "etrain-agent", "ag3nt-pw")
    try:
        agent.put("/etrain/nodes/n1", b"up")
    finally:
        agent.close()


def test_bootstrap_with_a_root_password_other_than_the_one_set_says_so_and_changes_nothing(
    tls_etcd: str, certs: Path
) -> None:
    bootstrap_etcd_auth(_config(tls_etcd, certs), PLAN)
    wrong = AuthBootstrap("not-it", PLAN.agent_user, "other-pw", PLAN.prefix)
    with pytest.raises(BootstrapError, match="cannot manage users with the given password"):
        bootstrap_etcd_auth(_config(tls_etcd, certs), wrong)
    agent = _client(tls_etcd, certs, "etrain-agent", "ag3nt-pw")  # its password is unchanged
    try:
        agent.put("/etrain/nodes/n1", b"up")
    finally:
        agent.close()


def test_the_bootstrapped_agents_user_runs_a_job_with_the_controller_as_root(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    """The command as the chart runs it, then the controller (root) and an agent under the agents' user:
    every key the agent touches while a job runs is inside its role."""
    (tmp_path / "root-pw").write_text("r00t-pw\n")
    (tmp_path / "agent-pw").write_text("ag3nt-pw\n")
    ca = ["--etcd-ca-cert", str(certs / "ca.pem")]
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "etcd-bootstrap",
        "--etcd",
        tls_etcd,
        *ca,
        "--etcd-password-file",
        str(tmp_path / "root-pw"),
        "--agent-password-file",
        str(tmp_path / "agent-pw"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "etcd authentication enabled: users 'root' and 'etrain-agent'"
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=_ROOT)
    assert again.returncode == 0 and "confirmed" in again.stdout, again.stderr

    controller = ["--etcd-user", "root", "--etcd-password-file", str(tmp_path / "root-pw")]
    agent = ["--etcd-user", "etrain-agent", "--etcd-password-file", str(tmp_path / "agent-pw")]
    service = Service(tmp_path, tls_etcd, ca, role_flags={"controller": controller, "agent": agent})
    try:
        job = service.run_one_node_job()
    finally:
        service.stop()
    assert job["state"] == "succeeded", job["last_error"]
    agent_log = (tmp_path / "agent.log").read_text()
    assert "permission denied" not in agent_log


def test_the_command_refuses_a_user_other_than_root_and_a_missing_agent_password(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    (tmp_path / "pw").write_text("x\n")
    base = [
        sys.executable,
        "-m",
        "service.cli",
        "etcd-bootstrap",
        "--etcd",
        tls_etcd,
        "--etcd-ca-cert",
        str(certs / "ca.pem"),
        "--etcd-password-file",
        str(tmp_path / "pw"),
    ]
    other = subprocess.run(
        [*base, "--etcd-user", "alice", "--agent-password-file", str(tmp_path / "pw")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=_ROOT,
    )
    assert other.returncode == 2 and "--etcd-user must be 'root'" in other.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    missing = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=_ROOT, env=env)
    assert missing.returncode == 2 and "--agent-password-file" in missing.stderr
    anonymous = _client(tls_etcd, certs)
    try:
        assert anonymous.user_list() == []  # nothing was made
    finally:
        anonymous.close()


# -- one etcd user per node (issue H3: whoever held the shared agents' user controlled the service) ----------------
NODES = AuthBootstrap(
    root_password="r00t-pw",
    agent_user=None,
    agent_password=None,
    prefix="/etrain",
    nodes=(("n1", "n1-pw"), ("n2", "n2-pw")),
)


def test_a_nodes_etcd_user_reaches_its_own_record_assignments_and_reports_and_nothing_else(
    tls_etcd: str, certs: Path
) -> None:
    """Before, the agents' one user read every job's secrets (``jobs/``, ``identities/``, every node's ``assign/``)
    and could inject jobs, which the leader scheduled past tokens, limits and quotas."""
    assert bootstrap_etcd_auth(_config(tls_etcd, certs), NODES) is BootstrapOutcome.ENABLED
    root = _client(tls_etcd, certs, "root", "r00t-pw")
    secrets = [
        "/etrain/jobs/j-1",
        "/etrain/identities/j-1",
        "/etrain/status/j-1",
        "/etrain/assign/n2/j-1",
        "/etrain/reports/n2/j-1",
        "/etrain/progress/j-1",
        "/etrain.rdzv/j-1.g1/state",
    ]
    for key in [*secrets, "/etrain/assign/n1/j-1"]:
        root.put(key, b'{"secret": "s3cret"}')
    node = _client(tls_etcd, certs, node_principal("n1"), "n1-pw")
    try:
        lease = node.grant_lease(timedelta(seconds=10))
        node.put("/etrain/nodes/n1", b"{}", lease=lease)  # its registration, on its lease
        (mine,), _ = node.read_prefixes(["/etrain/assign/n1/"])
        assert [kv.key for kv in mine] == ["/etrain/assign/n1/j-1"]
        node.put("/etrain/reports/n1/j-1", b"{}")
        node.wait_for_event("/etrain/assign/n1/", 0, timedelta(seconds=0.2), prefix=True)  # it may watch them
        for key in secrets:
            with pytest.raises(EtcdError, match="permission denied"):
                node.get(key)
        for key in [
            *secrets,
            "/etrain/assign/n1/j-2",
            "/etrain/nodes/n2",
            "/etrain/nodes/n10",
            "/etrain/leader",
            "/etrain/cancel/j-1",
        ]:
            with pytest.raises(EtcdError, match="permission denied"):
                node.put(key, b"{}")
        with pytest.raises(EtcdError, match="permission denied"):
            node.get_prefix("/etrain/assign/")  # every node's assignments
    finally:
        node.close()
        root.close()


def test_bootstrap_takes_back_grants_of_an_earlier_prefix_and_removes_a_node_that_left(
    tls_etcd: str, certs: Path
) -> None:
    """Before, a run with another ``--prefix`` kept the old grant too (L5)."""
    old = AuthBootstrap(
        root_password="r00t-pw",
        agent_user="etrain-agent",
        agent_password="ag3nt-pw",
        prefix="/old",
        nodes=(("n1", "n1-pw"),),
    )
    bootstrap_etcd_auth(_config(tls_etcd, certs), old)
    new = AuthBootstrap(
        root_password="r00t-pw",
        agent_user="etrain-agent",
        agent_password="ag3nt-pw",
        prefix="/etrain",
        nodes=(("n1", "n1-pw"),),
        remove_nodes=("n2",),
    )
    bootstrap_etcd_auth(_config(tls_etcd, certs), new)
    root = _client(tls_etcd, certs, "root", "r00t-pw")
    try:
        by_key = {"key": lambda p: (p.key, p.prefix)}
        assert root.role_permissions(AGENT_ROLE) == sorted(agent_permissions("/etrain"), **by_key)  # type: ignore[arg-type]
        assert root.role_permissions(node_principal("n1")) == sorted(
            node_permissions("/etrain", "n1"), key=lambda p: (p.key, p.prefix)
        )
        bootstrap_etcd_auth(_config(tls_etcd, certs), NODES)
        assert node_principal("n2") in root.user_list()
        gone = AuthBootstrap(
            root_password="r00t-pw", agent_user=None, agent_password=None, prefix="/etrain", remove_nodes=("n2",)
        )
        bootstrap_etcd_auth(_config(tls_etcd, certs), gone)
        assert node_principal("n2") not in root.user_list()
    finally:
        root.close()
    with pytest.raises(EtcdError):
        _client(tls_etcd, certs, node_principal("n2"), "n2-pw").get("/etrain/nodes/n2")


def test_an_agent_as_its_nodes_own_etcd_user_runs_a_job_with_the_controller_as_root(
    tls_etcd: str, certs: Path, tmp_path: Path
) -> None:
    """The command with ``--node``: it writes the node's password file, and an agent holding it (and nothing more)
    registers, runs a job and reports: every key the agent touches is inside its node's role."""
    (tmp_path / "root-pw").write_text("r00t-pw\n")
    ca = ["--etcd-ca-cert", str(certs / "ca.pem")]
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "etcd-bootstrap",
        "--etcd",
        tls_etcd,
        *ca,
        "--etcd-password-file",
        str(tmp_path / "root-pw"),
        "--node",
        "n1",
        "--node-password-dir",
        str(tmp_path / "nodes"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=_ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "etcd authentication enabled: users 'root' and 'etrain-node-n1'"
    password_file = tmp_path / "nodes" / "n1"
    assert password_file.stat().st_mode & 0o777 == 0o600
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=_ROOT, env=env)
    assert again.returncode == 0 and "confirmed" in again.stdout, again.stderr

    controller = ["--etcd-user", "root", "--etcd-password-file", str(tmp_path / "root-pw")]
    agent = ["--etcd-user", node_principal("n1"), "--etcd-password-file", str(password_file)]
    service = Service(tmp_path, tls_etcd, ca, role_flags={"controller": controller, "agent": agent})
    try:
        job = service.run_one_node_job()
    finally:
        service.stop()
    assert job["state"] == "succeeded", job["last_error"]
    assert "permission denied" not in (tmp_path / "agent.log").read_text()
