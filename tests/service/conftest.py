"""Fixtures of the service tests: a controller app on the shared real etcd, isolated by key prefix."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from service.api.app import create_app
from service.core.config import EtcdOptions, Role, Settings, TokenEntry
from service.core.view import ReconcileConfig
from tests.service.tls_etcd import certs, tls_etcd  # noqa: F401  (fixtures of the TLS etcd tests)

ADMIN = "admin-token-0123456789"
READER = "read-token-0123456789"
USER = "user-token-0123456789"  # role user, named carol
OTHER_USER = "user-token-9876543210"  # role user, named dave


def make_settings(etcd: LocalEtcdCluster, prefix: str, **kw: object) -> Settings:
    base: dict[str, object] = {
        "etcd": EtcdOptions(etcd.endpoints, connect_timeout=timedelta(seconds=2)),
        "prefix": prefix,
        "tokens": (
            TokenEntry(ADMIN, Role.ADMIN, "alice"),
            TokenEntry(READER, Role.READ, "bob"),
            TokenEntry(USER, Role.USER, "carol"),
            TokenEntry(OTHER_USER, Role.USER, "dave"),
        ),
        "leader_ttl": timedelta(seconds=2),
        "reconcile_interval": timedelta(seconds=0.3),
        "reconcile": ReconcileConfig(success_grace=timedelta(seconds=5), failure_settle=timedelta(seconds=1)),
    }
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


@pytest.fixture
def settings(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Settings:
    return make_settings(etcd_server, key_prefix, checkpoint_root=f"file://{tmp_path}/ckpt")


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    """The app with its reconcile loop running; requests carry the admin token unless overridden."""
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        yield client


@pytest.fixture
def live_server(settings: Settings) -> Iterator[str]:
    """The app served by uvicorn on a loopback port (for the CLI), its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)
