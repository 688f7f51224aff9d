"""Shared fixtures: real etcd servers on free loopback ports, each with its own temporary data dir."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd import EtcdClient, create_client
from elastic.testing.etcd_server import LocalEtcdCluster


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcdCluster]:
    """One etcd member shared by the session; tests isolate themselves by key prefix."""
    cluster = LocalEtcdCluster(1, workdir=tmp_path_factory.mktemp("etcd-shared"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_member(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    """A one-member etcd of the test's own (to restart or kill)."""
    cluster = LocalEtcdCluster(1, workdir=tmp_path / "etcd")
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_cluster3(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    """A three-member etcd cluster of the test's own (HA tests)."""
    cluster = LocalEtcdCluster(3, workdir=tmp_path / "etcd3")
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_client(etcd_server: LocalEtcdCluster) -> Iterator[EtcdClient]:
    client = create_client(etcd_server.config(op_timeout=5))
    yield client
    client.close()


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses."""
    return f"/test/{uuid.uuid4().hex[:12]}"
