"""Fixtures for the deployment tests: the chart loaded through the real Helm SDK (helm-python-sdk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "etrain"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
RELEASE = "demo"
NAMESPACE = "ml"


def load_values(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()  # the Go library logs `fail` calls to stderr; results are checked instead
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(params=CI_VALUES, ids=[p.name for p in CI_VALUES])
def ci_values_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path
