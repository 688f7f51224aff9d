"""A watch that simply times out is a timeout, not an etcd failure (found through the chaos suite's logs)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastic.etcd import create_client
from elastic.testing.etcd_server import LocalEtcdCluster


@pytest.mark.timeout(60)
def test_wait_for_event_returns_false_at_its_timeout_and_never_raises(etcd_cluster3: LocalEtcdCluster) -> None:
    # etcd may end a watch stream cut by its deadline with status UNKNOWN, "context deadline exceeded";
    # the node agents logged that as "etcd unavailable" about once a second before this was handled.
    client = create_client(etcd_cluster3.config())
    try:
        results = [client.wait_for_event("/quiet/", 1, timedelta(seconds=0.2), prefix=True) for _ in range(20)]
    finally:
        client.close()
    assert results == [False] * 20
