"""The controller's ASGI app on a real etcd, with authentication on, for schema-driven fuzzing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis

from elastic.etcd import create_client
from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from service.core.config import EtcdOptions, Role, Settings, TokenEntry

ADMIN_TOKEN = "fuzz-admin-token-0123456789abcdef"


@pytest.fixture
def api_schema(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[Any]:
    settings = Settings(
        etcd=EtcdOptions(etcd_server.endpoints),
        prefix=key_prefix,
        tokens=(TokenEntry(ADMIN_TOKEN, Role.ADMIN, "fuzz"),),
        checkpoint_root=f"file://{tmp_path / 'checkpoints'}",
        run_controller=False,  # the API only: no leader campaign, nothing scheduled
    )
    client = create_client(settings.etcd.config())
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(settings, client=client))
    finally:
        client.close()
