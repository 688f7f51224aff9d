"""Fixtures of the integration tests (real torchrun agents, real etcd from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.testing.torchrun import TorchrunAgent


@pytest.fixture
def agents() -> Iterator[list[TorchrunAgent]]:
    """Agents a test started (append them here): each is stopped with its whole process tree at the end."""
    started: list[TorchrunAgent] = []
    yield started
    for a in started:
        a.stop()
