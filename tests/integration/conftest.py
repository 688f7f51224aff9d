"""Fixtures of the integration tests (real torchrun agents, real etcd from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.testing.torchrun import Agent


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents a test started (append them here): each is stopped with its whole process tree at the end."""
    started: list[Agent] = []
    yield started
    for a in started:
        a.stop()
