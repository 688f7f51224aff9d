"""What the logs proxy (``GET /v1/jobs/{id}/logs``) does with an agent's answer that no real agent gives, through the
real controller (uvicorn, a real etcd) and an HTTP server of the test's own standing in for the node's agent: an error
with a huge body is read only a few KiB deep (the server counts what it could send before the proxy hung up), an
error body that never ends costs a few seconds even when following, an agent that never answers is given up when
following too, and an ``X-Etrain-Generation`` of non-ASCII digits is ignored instead of failing the request."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from elastic.etcd import EtcdClient
from service.api.routes import logs
from service.api.routes.logs import ERROR_BODY_BYTES, ERROR_BODY_TIMEOUT, generation_header
from service.core.config import Settings
from service.core.keys import Keys, dump
from service.core.models import NodeInfo
from tests.service.conftest import ADMIN

SPEC: dict[str, Any] = {"name": "logged", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 1}
HUGE = 256 << 20  # the error body the fake agent offers: 256 MiB
CHUNK = 64 << 10


class _Agent(ThreadingHTTPServer):
    """Answers every GET with ``answer(handler)``; ``sent`` counts the body bytes the socket took, ``done`` is set
    when the answer ended (sent whole, or the peer hung up)."""

    daemon_threads = True

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler], int]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.sent = 0
        self.done = threading.Event()
        self.stop = threading.Event()  # ends an answer that would otherwise stall forever


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Agent

    def do_GET(self) -> None:
        # a small send buffer: what the kernel holds for a peer that stopped reading stays small too
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        try:
            self.server.sent = self.server.answer(self)
        finally:
            self.server.done.set()
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _huge_error(handler: BaseHTTPRequestHandler) -> int:
    handler.send_response(500)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Content-Length", str(HUGE))
    handler.end_headers()
    chunk = b"x" * (CHUNK - 1) + b"\n"
    sent = 0
    try:
        while sent < HUGE:
            handler.wfile.write(chunk)
            sent += len(chunk)
    except OSError:  # the proxy hung up
        pass
    return sent


def _stalled_error(handler: BaseHTTPRequestHandler) -> int:
    handler.send_response(500)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    handler.wfile.write(b"disk on fire\n")
    handler.wfile.flush()
    handler.server.stop.wait(60)  # type: ignore[attr-defined]
    return 13


def _no_answer(handler: BaseHTTPRequestHandler) -> int:
    handler.server.stop.wait(60)  # type: ignore[attr-defined]
    return 0


def _superscript_generation(handler: BaseHTTPRequestHandler) -> int:
    body = b"a line of the log\n"
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("X-Etrain-Generation", "\u00b2")  # '²': str.isdigit() says yes, int() says no
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    return len(body)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[BaseHTTPRequestHandler], int]], _Agent]]:
    started: list[tuple[_Agent, threading.Thread]] = []

    def start(answer: Callable[[BaseHTTPRequestHandler], int]) -> _Agent:
        server = _Agent(answer)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def client(live_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as c:
        yield c


def _register(etcd_client: EtcdClient, settings: Settings, name: str, agent: _Agent) -> None:
    port = agent.server_address[1]
    info = NodeInfo(
        name=name,
        capacity=1,
        rdzv_host="127.0.0.1",
        hostname="node-host",
        incarnation="x",
        registered_at=datetime.now(timezone.utc),
        logs_url=f"http://127.0.0.1:{port}",
        logs_token="t" * 32,
    )
    lease = etcd_client.grant_lease(timedelta(seconds=300))  # as an agent registers: on a lease
    etcd_client.put(Keys(settings.prefix).node(name), dump(info), lease=lease)


@pytest.mark.timeout(60)
def test_an_agent_error_with_a_huge_body_is_read_only_a_few_kib_deep_and_answered_502_at_once(
    client: httpx.Client, settings: Settings, etcd_client: EtcdClient, serve: Any
) -> None:
    agent = serve(_huge_error)
    _register(etcd_client, settings, "huge", agent)
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    started = time.monotonic()
    resp = client.get(f"/v1/jobs/{job_id}/logs", params={"node": "huge"})
    took = time.monotonic() - started
    assert resp.status_code == 502, resp.text
    detail = resp.json()["detail"]
    assert detail.startswith("the agent of node huge answered HTTP 500: xxx") and len(detail) < 400
    assert agent.done.wait(20), "the fake agent is still sending: the proxy did not hang up"
    # what the proxy read, plus what the kernel's socket buffers took before the proxy closed the connection
    assert agent.sent < 8 << 20, f"the proxy read {agent.sent} bytes of a {HUGE}-byte error body"
    assert took < 10, took


@pytest.mark.timeout(60)
def test_an_agent_error_whose_body_never_ends_gets_502_within_seconds_also_when_following(
    client: httpx.Client, settings: Settings, etcd_client: EtcdClient, serve: Any
) -> None:
    _register(etcd_client, settings, "stalled", serve(_stalled_error))
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    started = time.monotonic()
    resp = client.get(
        f"/v1/jobs/{job_id}/logs", params={"node": "stalled", "follow": "true"}, timeout=ERROR_BODY_TIMEOUT + 10
    )
    assert resp.status_code == 502, resp.text
    assert resp.json()["detail"] == "the agent of node stalled answered HTTP 500: disk on fire"
    assert time.monotonic() - started < ERROR_BODY_TIMEOUT + 5


@pytest.mark.timeout(60)
def test_an_agent_that_never_answers_a_followed_log_gets_503_after_the_read_timeout(
    client: httpx.Client, settings: Settings, etcd_client: EtcdClient, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "READ_TIMEOUT", 2.0)  # (30 s in service)
    _register(etcd_client, settings, "mute", serve(_no_answer))
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    started = time.monotonic()
    resp = client.get(f"/v1/jobs/{job_id}/logs", params={"node": "mute", "follow": "true"}, timeout=20)
    assert resp.status_code == 503, resp.text
    assert resp.json()["detail"].startswith("cannot reach the agent of node mute at http://127.0.0.1:")
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_generation_header_of_non_ascii_digits_is_ignored_not_a_500(
    client: httpx.Client, settings: Settings, etcd_client: EtcdClient, serve: Any
) -> None:
    _register(etcd_client, settings, "odd", serve(_superscript_generation))
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    resp = client.get(f"/v1/jobs/{job_id}/logs", params={"node": "odd"})
    assert resp.status_code == 200, resp.text
    assert resp.text == "a line of the log\n"
    assert "x-etrain-generation" not in resp.headers  # the agent's was no number, and none was asked for
    resp = client.get(f"/v1/jobs/{job_id}/logs", params={"node": "odd", "generation": 3})
    assert resp.status_code == 200 and resp.headers["x-etrain-generation"] == "3"  # the one asked for


def test_generation_header_takes_ascii_digits_only_within_bounds() -> None:
    assert generation_header("7", None) == 7
    assert generation_header(str(2**31), None) == 2**31
    for bad in ("\u00b2", "\u0663", "\uff17", "", " 7", "7 ", "+7", "-1", "0x7", "1" * 11, str(2**31 + 1), None):
        assert generation_header(bad, 4) == 4, bad
    assert ERROR_BODY_BYTES <= 64 << 10
