"""etcd over TLS (client certificates, or user/password): controller, agent and torchrun's rendezvous.

A real etcd is started with a server certificate made by ``openssl`` for 127.0.0.1; the controller and
an agent run as ``etrain`` processes and a one-node job runs through torchrun's etcd-v3 rendezvous.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd import EtcdConfig, create_client
from elastic.testing.etcd_server import find_etcd_binary, free_port
from service.cli.client import ApiClient
from tests.integration.service_harness import wait_api

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates"),
]
_ROOT = Path(__file__).resolve().parents[2]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    (d / "ext.cnf").write_text(
        "[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=etrain-test-ca",
        cwd=d,
    )
    for name, cn in (("server", "127.0.0.1"), ("client", "root")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={cn}",
            "-config",
            "ext.cnf",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-extensions",
            "ext",
            cwd=d,
        )
    return d


def _start_tls_etcd(
    workdir: Path, certs: Path, client_cert_auth: bool
) -> tuple[subprocess.Popen[bytes], str]:
    port, peer = free_port(), free_port()
    cmd = [
        find_etcd_binary(),
        "--name",
        "m0",
        "--data-dir",
        str(workdir / "data"),
        "--listen-client-urls",
        f"https://127.0.0.1:{port}",
        "--advertise-client-urls",
        f"https://127.0.0.1:{port}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"m0=http://127.0.0.1:{peer}",
        "--cert-file",
        str(certs / "server.pem"),
        "--key-file",
        str(certs / "server.key"),
        "--log-level",
        "warn",
    ]
    if client_cert_auth:  # etcd 3.4 asks every client for a certificate once it has a trusted CA
        cmd += ["--trusted-ca-file", str(certs / "ca.pem"), "--client-cert-auth"]
    with open(workdir / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


class _Service:
    def __init__(self, workdir: Path, endpoint: str, flags: list[str]) -> None:
        self.workdir, self.endpoint, self.flags = workdir, endpoint, flags
        self.procs: list[subprocess.Popen[bytes]] = []

    def etrain(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
        env["PYTHONPATH"] = str(_ROOT)
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", *args, "--etcd", self.endpoint, *self.flags],
                env=env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def run_one_node_job(self) -> dict[str, object]:
        port = free_port()
        self.etrain(
            "controller", "controller", "--host", "127.0.0.1", "--port", str(port), "--leader-ttl", "2"
        )
        self.etrain(
            "agent",
            "agent",
            "--node-name",
            "n1",
            "--work-dir",
            str(self.workdir / "work"),
            "--rdzv-host",
            "127.0.0.1",
            "--lease-ttl",
            "2",
        )
        api = ApiClient(f"http://127.0.0.1:{port}")
        wait_api("the controller", api.ready, 60)
        wait_api("the node", lambda: len(api.nodes()) == 1, 60)
        script = self.workdir / "worker.py"
        script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
        job = api.submit({"name": "tls", "entrypoint": str(script), "rendezvous": {"last_call_timeout": 1}})
        done = wait_api(
            "the job to end", lambda: (j := api.job(job["id"]))["state"] in ("succeeded", "failed") and j, 90
        )
        assert isinstance(done, dict)
        return done

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def tls_etcd(request: pytest.FixtureRequest, tmp_path: Path, certs: Path) -> Iterator[str]:
    proc, endpoint = _start_tls_etcd(tmp_path, certs, client_cert_auth=request.param)
    options = {"ca_cert": str(certs / "ca.pem"), "op_timeout": "20"}
    if request.param:
        options.update(cert=str(certs / "client.pem"), cert_key=str(certs / "client.key"))
    config = EtcdConfig.from_options(endpoint, options)
    client = create_client(config)
    client.ping()  # waits until the member serves
    client.close()
    yield endpoint
    proc.terminate()
    proc.wait(timeout=20)


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
    subprocess.run(
        [*ctl, "user", "add", "root:s3cret-pw"], check=True, capture_output=True, env=env, timeout=30
    )
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
