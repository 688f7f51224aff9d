"""The logs proxy (``GET /v1/jobs/{id}/logs``) under attack, through the real app on a real etcd: a node record whose
``logs_url`` reaches another path (a trailing ``#`` or ``?``), another host, user info or a non-numeric port makes the
controller send nothing anywhere (a 502 naming the node), while a well-formed one on a registered host is read; and a
read token gets 403 for logs while an admin token reads them. The "other server" is an HTTP server of the test's own on
loopback that records every request it gets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import free_port
from elastic.testing.wait import wait_for
from service.agent.logs import log_path
from service.agent.node import NodeAgent, create_agent
from service.core.config import AgentSettings, Settings
from service.core.keys import Keys, dump
from service.core.models import NodeInfo
from tests.service.conftest import ADMIN, READER

SPEC: dict[str, Any] = {"name": "logged", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 1}


class _Recorder(BaseHTTPRequestHandler):
    paths: list[str]

    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        body = b"SECRET metadata of the controller's network\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(params=["127.0.0.1", "127.0.0.2"])
def victim(request: pytest.FixtureRequest) -> Iterator[ThreadingHTTPServer]:
    """An HTTP server that is no agent (on the controller's loopback, and on another loopback address)."""
    server = ThreadingHTTPServer((request.param, 0), _Recorder)
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _node(name: str, logs_url: str) -> NodeInfo:
    return NodeInfo(
        name=name,
        capacity=1,
        rdzv_host="127.0.0.1",
        hostname="node-host",
        incarnation="x",
        registered_at=datetime.now(timezone.utc),
        logs_url=logs_url,
        logs_token="t" * 32,
    )


@pytest.mark.timeout(60)
def test_a_node_record_pointing_the_logs_proxy_elsewhere_gets_nothing_sent(
    api: TestClient, settings: Settings, etcd_client: EtcdClient, victim: ThreadingHTTPServer
) -> None:
    host, port = victim.server_address[:2]
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    keys = Keys(settings.prefix)
    for i, url in enumerate(
        (
            f"http://{host}:{port}/latest/meta-data#",  # the fixed path ends up in the fragment
            f"http://{host}:{port}/latest/meta-data?x=",  # ... or in the query
            f"http://{host}:{port}#",
            f"http://user:pw@{host}:{port}",
            f"http://{host}:{port}/",  # a well-formed URL, but on 127.0.0.2: not the node's host
            f"ftp://{host}:{port}",
            f"http://{host}:{port}x",
            f"http://{host}",
        )
    ):
        if url == f"http://{host}:{port}/" and host == "127.0.0.1":
            continue  # loopback is a registered host: that one is asked (below)
        lease = etcd_client.grant_lease(timedelta(seconds=300))  # a record on no lease is no node at all
        etcd_client.put(keys.node(f"evil-{i}"), dump(_node(f"evil-{i}", url)), lease=lease)
        resp = api.get(f"/v1/jobs/{job_id}/logs", params={"node": f"evil-{i}"})
        assert resp.status_code == 502, (url, resp.status_code, resp.text)
        assert f"node evil-{i} published a logs_url that is refused" in resp.json()["detail"], url
        assert "SECRET" not in resp.text
    assert victim.paths == []  # type: ignore[attr-defined]


def test_checked_logs_url_rebuilds_the_address_from_checked_parts() -> None:
    from service.core.models import checked_logs_url  # (imported here: the module's other tests run without it)

    ok = {
        "http://127.0.0.1:8082": "http://127.0.0.1:8082",
        "http://127.0.0.1:8082/": "http://127.0.0.1:8082",
        "https://NODE-HOST:443": "https://node-host:443",
        "http://[::1]:9": "http://[::1]:9",
        "http://localhost:8082": "http://localhost:8082",
    }
    for url, base in ok.items():
        assert checked_logs_url(_node("n", url)) == base
    for url in (
        "http://127.0.0.1:8082/x",
        "http://127.0.0.1:8082#",
        "http://127.0.0.1:8082?",
        "http://10.1.2.3:1",
        "http://a@127.0.0.1:1",
        "http://127.0.0.1:0",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:8082 x",
        "http://127.0.0.1\\@other:1",
        "",
        "gopher://127.0.0.1:1",
    ):
        with pytest.raises(ValueError):
            checked_logs_url(_node("n", url))


@pytest.fixture
def agent(settings: Settings, tmp_path: Path) -> Iterator[NodeAgent]:
    agent = create_agent(
        AgentSettings(
            etcd=settings.etcd,
            node_name="node-a",
            prefix=settings.prefix,
            work_dir=tmp_path / "node-a",
            rdzv_host="127.0.0.1",
            logs_port=free_port(),
            logs_host="127.0.0.1",
        )
    )
    agent.register()
    yield agent
    agent.shutdown()


@pytest.mark.timeout(60)
def test_read_tokens_get_403_for_logs_admin_tokens_read_them(api: TestClient, agent: NodeAgent) -> None:
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["nodes"] == ["node-a"], what="placed")
    path = log_path(agent.settings.work_dir, job_id, 1, "node-a")
    path.parent.mkdir(parents=True)
    path.write_text("password=hunter2 printed by the workers\n")
    for params in ({}, {"node": "node-a"}, {"follow": "true", "node": "node-a"}):
        refused = api.get(f"/v1/jobs/{job_id}/logs", params=params, headers={"Authorization": f"Bearer {READER}"})
        assert refused.status_code == 403, refused.text
        assert "read tokens cannot read them" in refused.json()["detail"] and "hunter2" not in refused.text
    resp = api.get(f"/v1/jobs/{job_id}/logs", params={"node": "node-a"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 200 and "hunter2" in resp.text
