"""The agent's job-log server (service/agent/logs.py): on real log files, and under a real agent on a real etcd
running a real torchrun whose log it follows while the workers write and until the agent stops them."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from elastic.testing.etcd_server import LocalEtcdCluster, free_port
from elastic.testing.wait import wait_for
from service.agent.logs import LogServer, log_path
from service.agent.node import NodeAgent, create_agent
from service.core.config import AgentSettings, EtcdOptions
from service.core.models import Assignment, JobSpec

pytestmark = pytest.mark.timeout(90)

TOKEN = "log-token-0123456789abcdef"
JOB = "train-0a1b2c3d"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A work dir with the logs an agent of node n1 leaves: generations 1 and 2 of JOB here; generation 3 of
    JOB placed on other nodes only; a secret outside the jobs directory."""
    work = tmp_path / "work"
    for generation, text in ((1, "first generation\n"), (2, "+ torchrun ...\nline 1\nline 2\nline 3\n")):
        path = log_path(work, JOB, generation, "n1")
        path.parent.mkdir(parents=True)
        path.write_text(text)
    (work / "jobs" / JOB / "g3").mkdir()
    (work / "jobs" / JOB / "g3" / "n2.log").write_text("another node's\n")
    (tmp_path / "secret.txt").write_text("not a log\n")
    return work


@pytest.fixture
def server(work: Path) -> Iterator[LogServer]:
    running: set[tuple[str, int]] = set()
    srv = LogServer(work, "n1", TOKEN, lambda job, gen: (job, gen) in running, host="127.0.0.1").start()
    yield srv
    srv.close()


def _raw_get(port: int, path: str, token: str | None = TOKEN) -> tuple[int, str]:
    """GET ``path`` exactly as written (httpx would normalise dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_every_request_needs_the_bearer_token(server: LogServer) -> None:
    url = f"http://127.0.0.1:{server.port}/jobs/{JOB}/logs"
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ):
        resp = httpx.get(url, headers=headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", headers
        assert "line" not in resp.text
    # refused before the path is looked at: an unauthenticated caller learns nothing of what exists
    assert _raw_get(server.port, "/jobs/no-such-job/logs", token=None)[0] == 401
    assert _raw_get(server.port, "/elsewhere", token=None)[0] == 401
    resp = httpx.get(url, headers={"Authorization": f"bearer {TOKEN}"})  # the scheme is case-insensitive
    assert resp.status_code == 200 and "line 3" in resp.text


def test_newest_generation_by_default_and_a_named_one(server: LogServer) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"http://127.0.0.1:{server.port}/jobs/{JOB}/logs"
    resp = httpx.get(url, headers=headers)
    # generation 3 of the job ran on other nodes only: this node's newest is 2
    assert resp.status_code == 200 and resp.headers["x-etrain-generation"] == "2"
    assert resp.text == "+ torchrun ...\nline 1\nline 2\nline 3\n"
    assert resp.headers["content-type"].startswith("text/plain")
    resp = httpx.get(url, headers=headers, params={"generation": 1})
    assert (resp.status_code, resp.text, resp.headers["x-etrain-generation"]) == (200, "first generation\n", "1")
    assert httpx.get(url, headers=headers, params={"generation": 3}).status_code == 404
    missing = httpx.get(f"http://127.0.0.1:{server.port}/jobs/other-00000000/logs", headers=headers)
    assert missing.status_code == 404 and "no log of job other-00000000" in missing.text
    # tail: from N bytes before the end, moved forward to a whole line; offset: from that byte
    resp = httpx.get(url, headers=headers, params={"tail": 10})
    assert resp.text == "line 3\n" and int(resp.headers["x-etrain-offset"]) == len("+ torchrun ...\nline 1\nline 2\n")
    assert httpx.get(url, headers=headers, params={"tail": 0}).text == ""
    assert httpx.get(url, headers=headers, params={"offset": 15}).text == "line 1\nline 2\nline 3\n"
    assert httpx.get(url, headers=headers, params={"tail": "-1"}).status_code == 400
    assert httpx.get(url, headers=headers, params={"generation": "0"}).status_code == 400


@pytest.mark.parametrize(
    "path",
    [
        "/jobs/../../secret.txt/logs",
        "/jobs/..%2F..%2Fsecret.txt/logs",
        "/jobs/%2e%2e/logs",
        "/jobs/../logs",
        f"/jobs/{JOB}/../../../secret.txt",
        f"/jobs/{JOB}/logs?generation=../../secret",
        f"/jobs/{JOB}/logs?generation=1/../2",
        "/jobs/UPPER-case/logs",
        "/jobs/a.b/logs",
    ],
)
def test_paths_outside_a_jobs_log_are_refused(server: LogServer, path: str) -> None:
    status, body = _raw_get(server.port, path)
    assert status in (400, 404), (path, status)
    assert "not a log" not in body


def test_a_log_that_is_a_symlink_out_of_the_jobs_directory_is_not_served(server: LogServer, work: Path) -> None:
    # a job runs as the agent's user and could plant one where the agent keeps its logs
    planted = log_path(work, "evil-00000000", 1, "n1")
    planted.parent.mkdir(parents=True)
    planted.symlink_to(work.parent / "secret.txt")
    outside = work.parent / "outside"
    (outside / "g1").mkdir(parents=True)
    (outside / "g1" / "n1.log").write_text("not a log either\n")
    (work / "jobs" / "evil2-00000000").symlink_to(outside, target_is_directory=True)
    for path in ("/jobs/evil-00000000/logs", "/jobs/evil-00000000/logs?generation=1", "/jobs/evil2-00000000/logs"):
        status, body = _raw_get(server.port, path)
        assert status == 404 and "not a log" not in body, (path, body)


# -- under a real agent ----------------------------------------------------------------------------------------

_TICKER = """
import sys, time
i = 0
while True:
    print(f"tick {i}", flush=True)
    i += 1
    time.sleep(0.2)
"""


@pytest.fixture
def agent(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Iterator[NodeAgent]:
    settings = AgentSettings(
        etcd=EtcdOptions(etcd_server.endpoints),
        node_name="n1",
        prefix=key_prefix,
        work_dir=tmp_path / "work",
        rdzv_host="127.0.0.1",
        lease_ttl=timedelta(seconds=2),
        poll_interval=timedelta(seconds=0.2),
        stop_grace=timedelta(seconds=5),
        logs_port=free_port(),
        logs_host="127.0.0.1",
    )
    a = create_agent(settings)
    stop = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: a.healthy()[0], what="the agent to run")
    yield a
    stop.set()
    thread.join(timeout=30)


def test_agent_publishes_its_log_server_and_follow_streams_until_the_job_is_stopped(
    agent: NodeAgent, tmp_path: Path
) -> None:
    [info], _ = agent.store.list_nodes()
    assert info.logs_url == f"http://127.0.0.1:{agent.settings.logs_port}"
    assert info.logs_token == agent.logs_token and len(agent.logs_token) >= 32
    assert agent.logs_token not in repr(info)

    script = tmp_path / "ticker.py"
    script.write_text(_TICKER)
    a = Assignment(
        job_id=JOB,
        generation=1,
        assigned_at=datetime.now(timezone.utc),
        spec=JobSpec(name="train", entrypoint=str(script), rendezvous={"last_call_timeout": 1}),
    )  # type: ignore[arg-type]
    key = agent.store.keys.assignment("n1", JOB)
    agent.client.put(key, a.model_dump_json().encode())
    wait_for(lambda: agent.runs(JOB, 1), what="the torchrun to start")

    received: list[bytes] = []
    ended = threading.Event()

    def follow() -> None:
        with httpx.stream(
            "GET",
            f"{info.logs_url}/jobs/{JOB}/logs",
            params={"follow": 1, "offset": 0},
            headers={"Authorization": f"Bearer {info.logs_token}"},
            timeout=30,
        ) as resp:
            assert resp.status_code == 200 and resp.headers["x-etrain-generation"] == "1"
            for chunk in resp.iter_raw():
                received.append(chunk)
        ended.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    # lines arrive while the workers write them ...
    wait_for(lambda: b"tick 3\n" in b"".join(received), 60, what="ticks streamed")
    seen = b"".join(received)
    wait_for(lambda: b"".join(received).count(b"tick") > seen.count(b"tick") + 2, 10, what="more ticks")
    assert not ended.is_set() and agent.runs(JOB, 1)
    assert b"".join(received).startswith(b"+ ")  # offset=0: the whole file, the command line first

    agent.client.delete(key)  # unassigned: the agent stops the torchrun, the stream then ends
    stopped = time.monotonic()
    assert ended.wait(30), "the followed log did not end after the job stopped"
    assert not agent.runs(JOB, 1) and time.monotonic() - stopped < 20
    text = b"".join(received)
    on_disk = log_path(agent.settings.work_dir, JOB, 1, "n1").read_bytes()
    assert text == on_disk  # everything, the last lines included, nothing twice
    reader.join(timeout=5)


def test_follow_of_a_log_whose_torchrun_is_gone_ends_after_the_file(server: LogServer) -> None:
    with httpx.stream(
        "GET",
        f"http://127.0.0.1:{server.port}/jobs/{JOB}/logs",
        params={"follow": "1"},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    ) as resp:
        assert resp.read() == b"+ torchrun ...\nline 1\nline 2\nline 3\n"


def test_a_follower_that_hangs_up_is_let_go_while_the_job_still_runs(work: Path) -> None:
    srv = LogServer(work, "n1", TOKEN, lambda job, gen: True, host="127.0.0.1").start()  # runs forever

    def handlers() -> int:
        """Connections this server serves now (threads by name would count other tests' servers too)."""
        return srv.open_connections

    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("GET", f"/jobs/{JOB}/logs?follow=1", headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read1(4096).startswith(b"+ torchrun")
        wait_for(lambda: handlers() == 1, 5, what="the follower's handler")
        with log_path(work, JOB, 2, "n1").open("a") as fh:
            fh.write("line 4\n")
        assert resp.read1(4096) == b"line 4\n"  # appended lines come
        resp.close()  # the client hangs up
        conn.close()
        wait_for(lambda: not handlers(), 10, what="the handler to notice the client left")
    finally:
        srv.close()
