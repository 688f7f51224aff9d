"""Fixtures of the integration tests (real torchrun agents, real etcd from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the torch compatibility runs install the library without the service's extras
    from service.testing.cluster import LocalServiceCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalServiceCluster]:
    """etcd under ``tmp_path``; the test starts the controller and the agents it needs. All stopped at the end."""
    from service.testing.cluster import LocalServiceCluster

    c = LocalServiceCluster(tmp_path, shared_zygote=True)
    try:
        yield c
    finally:
        c.stop()
