"""Fixtures for checkpoint tests: a real S3-compatible server (moto, own process, loopback, free port)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic.testing.s3_server import LocalS3Server


@pytest.fixture(scope="session", autouse=True)
def _aws_environment() -> Iterator[None]:
    """No real AWS config or instance metadata (169.254.169.254) is ever consulted by tests."""
    saved = {
        k: os.environ.get(k) for k in ("AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    }
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["AWS_CONFIG_FILE"] = "/nonexistent/aws-config"
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent/aws-credentials"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(key, None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    server = LocalS3Server(log_path=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    yield server
    server.stop()


@dataclass(frozen=True)
class Target:
    """Where a test stores snapshots: a URL and the fsspec storage options to reach it."""

    kind: str
    url: str
    storage_options: dict[str, Any]


@pytest.fixture
def s3_target(s3_server: LocalS3Server) -> Target:
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    return Target("s3", f"s3://{bucket}/job", s3_server.storage_options())


@pytest.fixture
def local_target(tmp_path: Path) -> Target:
    return Target("local", str(tmp_path / "ckpt"), {})


@pytest.fixture(params=["local", "s3"])
def target(request: pytest.FixtureRequest) -> Target:
    """Each test using it runs on a local directory and on the S3 server."""
    return request.getfixturevalue(f"{request.param}_target")
