"""Shared fixtures: real etcd servers on free loopback ports, each with its own temporary data dir.

Under pytest-xdist (``scripts/test.sh``) every worker is a process with its own session fixtures; its
servers take ports from a range of its own (``ETRAIN_PORT_RANGE``, below), and ``tests/parallel.py`` decides
which worker runs what.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd import EtcdClient, create_client
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.ports import PORT_RANGE_ENV
from elastic.testing.torchrun import TorchrunAgent
from tests.parallel import (  # noqa: F401  (hooks of the parallel run)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure_node,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_xdist_make_scheduler,
    use_loadgroup,
)

#: the ports the xdist workers' servers use, split evenly between them: below the kernel's ephemeral range
#: (32768 up), so no worker's probed-but-not-yet-bound port is offered to another worker or to a connection
WORKER_PORTS = (16000, 32000)


def pytest_configure(config: pytest.Config) -> None:
    use_loadgroup(config)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 0 and PORT_RANGE_ENV not in os.environ:
        span = (WORKER_PORTS[1] - WORKER_PORTS[0]) // count
        low = WORKER_PORTS[0] + int(worker[2:]) * span
        os.environ[PORT_RANGE_ENV] = f"{low}-{low + span - 1}"  # the worker's subprocesses inherit it


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


@pytest.fixture
def agents() -> Iterator[list[TorchrunAgent]]:
    """Agents a test started (append them here): each is stopped with its whole process tree at the end."""
    started: list[TorchrunAgent] = []
    yield started
    for a in started:
        a.stop()


@pytest.fixture
def gloo_world_1() -> Iterator[None]:
    """A gloo process group of one rank in this process (left behind by nobody, torn down after the test even
    if a trainer's ``close()`` already left it)."""
    import torch.distributed as dist  # here: most of the suite never loads torch

    from elastic import compat

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        compat.destroy_process_group()
