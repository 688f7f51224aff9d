"""The agent's log server cannot be held open by idle connections: one that sends no request within the request
timeout is closed and its thread ends, and connections beyond the limit are answered 503 at once (no thread each),
while a proper request is still served once the idle ones are gone."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from elastic.testing.wait import wait_for
from service.agent.logs import LogServer, log_path

pytestmark = pytest.mark.timeout(60)

TOKEN = "log-token-0123456789abcdef"
JOB = "train-0a1b2c3d"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LogServer]:
    path = log_path(tmp_path, JOB, 1, "n1")
    path.parent.mkdir(parents=True)
    path.write_text("hello\n")
    kwargs = {"request_timeout": 1.0, "max_connections": 4}
    srv = LogServer(tmp_path, "n1", TOKEN, lambda job, gen: False, host="127.0.0.1", **kwargs)  # type: ignore[arg-type]
    srv.start()
    yield srv
    srv.close()


def _handlers() -> int:
    return sum("process_request" in t.name for t in threading.enumerate() if t.is_alive())


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return False
    except OSError:
        return True
    return data == b"" or data.startswith(b"HTTP/1.1 503")


def test_idle_connections_time_out_and_beyond_the_limit_get_503(server: LogServer) -> None:
    before = _handlers()
    idle = []
    for _ in range(12):  # connect, send nothing
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        idle.append(sock)
    time.sleep(0.3)
    assert _handlers() - before <= 4  # not one thread per connection
    assert server.open_connections <= 4  # (how many were accepted by now depends on the machine's load)
    started = time.monotonic()
    for sock in idle:  # every one is closed by the server: the 8 over the limit at once, the others after 1 s
        assert _closed_by_server(sock)
        sock.close()
    assert time.monotonic() - started < 5
    # (<=: another test's server threads in this process may end meanwhile, never start)
    wait_for(
        lambda: server.open_connections == 0 and _handlers() <= before, 5, what="the idle connections' threads to end"
    )
    resp = httpx.get(f"http://127.0.0.1:{server.port}/jobs/{JOB}/logs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200 and resp.text == "hello\n"
