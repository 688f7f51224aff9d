"""An etcd serving TLS (certificates made by ``openssl`` for 127.0.0.1) and the service run against it.

``certs`` (module-scoped) and ``tls_etcd`` (parametrized indirectly: ``True`` = etcd asks for client
certificates) are fixtures, made available to ``tests/service`` by its conftest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd import EtcdConfig, create_client
from elastic.testing.etcd_server import find_etcd_binary, free_port
from service.client import ApiClient
from tests.integration.service_harness import wait_api

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


def _start_tls_etcd(workdir: Path, certs: Path, client_cert_auth: bool) -> tuple[subprocess.Popen[bytes], str]:
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


class Service:
    """The controller and one agent as ``etrain`` processes against ``endpoint`` with ``flags``."""

    def __init__(
        self, workdir: Path, endpoint: str, flags: list[str], role_flags: dict[str, list[str]] | None = None
    ) -> None:
        """``flags``: every process's; ``role_flags``: more for the one named so (``controller``, ``agent``)."""
        self.workdir, self.endpoint, self.flags = workdir, endpoint, flags
        self.role_flags = role_flags or {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def etrain(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
        env["PYTHONPATH"] = str(_ROOT)
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "service.cli",
                    *args,
                    "--etcd",
                    self.endpoint,
                    *self.flags,
                    *self.role_flags.get(name, []),
                ],
                env=env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def run_one_node_job(
        self,
        script_text: str | None = None,
        agent_args: tuple[str, ...] = (),
        where: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, object]:
        """``where``: the directory of the agent's work dir and the job's script (default: the service's)."""
        where = where or self.workdir
        port = free_port()
        self.etrain("controller", "controller", "--host", "127.0.0.1", "--port", str(port), "--leader-ttl", "2")
        self.etrain(
            "agent",
            "agent",
            "--node-name",
            "n1",
            "--work-dir",
            str(where / "work"),
            "--rdzv-host",
            "127.0.0.1",
            "--lease-ttl",
            "2",
            *agent_args,
        )
        api = ApiClient(f"http://127.0.0.1:{port}")
        wait_api("the controller", api.ready, 60)
        wait_api("the node", lambda: len(api.nodes()) == 1, 60)
        script = where / "worker.py"
        script.write_text(
            script_text or "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"
        )
        job = api.submit(
            {
                "name": "tls",
                "entrypoint": str(script),
                "rendezvous": {"last_call_timeout": 1},
                "env": env or {},
                "working_dir": str(where),
            }
        )
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
