"""``GET /v1/jobs/{id}/logs`` through the real app and its reconcile loop on a real etcd, read from real agents' log
servers: sections per node, one node's log, the errors (unknown job, offline node, an agent without --logs-port),
authentication like the other job reads, the agents' token never shown by /v1/nodes; and following a job whose
real torchruns write on two agents, lines interleaved as they come, until the job ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import free_port
from elastic.testing.wait import wait_for
from service.agent.logs import log_path
from service.agent.node import NodeAgent, create_agent
from service.core.config import AgentSettings, Settings
from tests.service.conftest import ADMIN, READER

SPEC: dict[str, Any] = {"name": "logged", "entrypoint": "train.py", "min_nodes": 2, "max_nodes": 2}


def _agent(settings: Settings, name: str, work: Path, logs: bool = True, **kw: Any) -> NodeAgent:
    return create_agent(
        AgentSettings(
            etcd=settings.etcd,
            node_name=name,
            prefix=settings.prefix,
            work_dir=work,
            rdzv_host="127.0.0.1",
            lease_ttl=timedelta(seconds=2),
            logs_port=free_port() if logs else 0,
            logs_host="127.0.0.1",
            **kw,
        )
    )


@pytest.fixture
def registered(settings: Settings, tmp_path: Path) -> Iterator[dict[str, NodeAgent]]:
    """Two agents registered, serving logs, without their loops (the leader assigns, nothing is started)."""
    agents = {name: _agent(settings, name, tmp_path / name) for name in ("node-a", "node-b")}
    for agent in agents.values():
        agent.register()
    yield agents
    for agent in agents.values():
        agent.shutdown()


@pytest.mark.timeout(60)
def test_logs_of_every_node_one_node_and_the_errors(
    api: TestClient, settings: Settings, registered: dict[str, NodeAgent], tmp_path: Path
) -> None:
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["nodes"] == ["node-a", "node-b"], what="placed")
    for name, agent in registered.items():  # what the torchruns wrote
        path = log_path(agent.settings.work_dir, job_id, 1, name)
        path.parent.mkdir(parents=True)
        path.write_text(f"+ torchrun ...\n{name} says hello\n{name} step 10")  # the last line unfinished
    read_only = api.get(f"/v1/jobs/{job_id}/logs", headers={"Authorization": f"Bearer {READER}"})
    assert read_only.status_code == 403 and "read-only" in read_only.json()["detail"]  # logs: not for read tokens
    reader = {"Authorization": f"Bearer {ADMIN}"}

    resp = api.get(f"/v1/jobs/{job_id}/logs", headers=reader)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert resp.headers["x-etrain-generation"] == "1"
    assert resp.text == (
        "==> node-a (generation 1) <==\n+ torchrun ...\nnode-a says hello\nnode-a step 10\n"
        "\n==> node-b (generation 1) <==\n+ torchrun ...\nnode-b says hello\nnode-b step 10\n"
    )
    one = api.get(f"/v1/jobs/{job_id}/logs", params={"node": "node-b"}, headers=reader)
    assert one.status_code == 200 and one.text == "+ torchrun ...\nnode-b says hello\nnode-b step 10"
    assert one.headers["x-etrain-node"] == "node-b" and one.headers["x-etrain-generation"] == "1"
    tail = api.get(f"/v1/jobs/{job_id}/logs", params={"node": "node-a", "tail": 16}, headers=reader)
    assert tail.text == "node-a step 10"  # the last 16 bytes, from the first whole line
    assert api.get(f"/v1/jobs/{job_id}/logs", params={"generation": 1}, headers=reader).text == resp.text

    # errors
    for params, code, words in (
        ({"node": "node-z"}, 503, "node node-z is offline"),
        ({"node": "node-a", "generation": 7}, 404, "node node-a has no log of job"),
        ({"generation": 7}, 404, "no live node has a log of job"),
        ({"node": "../etc"}, 422, "node"),
    ):
        err = api.get(f"/v1/jobs/{job_id}/logs", params=params, headers=reader)
        assert err.status_code == code and words in str(err.json()), (params, err.text)
    assert api.get("/v1/jobs/nope-00000000/logs", headers=reader).status_code == 404
    plain = _agent(settings, "node-c", tmp_path / "node-c", logs=False)  # no --logs-port
    plain.register()
    try:
        err = api.get(f"/v1/jobs/{job_id}/logs", params={"node": "node-c"}, headers=reader)
        assert err.status_code == 409 and "--logs-port" in err.json()["detail"]
    finally:
        plain.shutdown()
    # an agent that is gone (SIGKILLed: still registered until its lease ends) gets a note in its section
    registered["node-b"]._close_logs()
    resp = api.get(f"/v1/jobs/{job_id}/logs", headers=reader)
    assert resp.status_code == 200 and "node-a says hello" in resp.text
    assert "==> node-b (generation 1) <==\n[etrain] cannot reach the agent of node node-b" in resp.text
    assert api.get(f"/v1/jobs/{job_id}/logs", params={"node": "node-b"}, headers=reader).status_code == 503

    # authentication as for the other job reads
    path = f"/v1/jobs/{job_id}/logs"
    assert api.get(path, headers={"Authorization": ""}).status_code == 401
    assert api.get(path, headers={"Authorization": "Bearer not-a-token"}).status_code == 401
    assert api.get(path, headers={"Authorization": f"Bearer {registered['node-a'].logs_token}"}).status_code == 401
    assert path.replace(job_id, "{job_id}") in api.get("/openapi.json").json()["paths"]


@pytest.mark.timeout(60)
def test_nodes_never_show_the_agents_log_token(
    api: TestClient, settings: Settings, registered: dict[str, NodeAgent]
) -> None:
    for token in (ADMIN, READER):
        resp = api.get("/v1/nodes", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 200
        nodes = resp.json()["nodes"]
        assert [n["name"] for n in nodes] == ["node-a", "node-b"]
        for node, agent in zip(nodes, registered.values(), strict=True):
            assert agent.logs_token not in resp.text and "logs_token" not in node
            assert node["logs_url"] == f"http://127.0.0.1:{agent.settings.logs_port}"
    schema = api.get("/openapi.json").text
    assert "logs_token" not in schema


_TICKER = """
import os, sys, time
node = os.environ["ETRAIN_NODE_NAME"]
i = 0
while not os.path.exists(sys.argv[1]):
    print(f"tick {i} from {node}", flush=True)
    i += 1
    time.sleep(0.2)
print(f"bye from {node}", flush=True)
"""


@pytest.mark.timeout(120)
def test_follow_interleaves_both_nodes_lines_until_the_job_ends(
    live_server: str, settings: Settings, tmp_path: Path
) -> None:
    script, done = tmp_path / "ticker.py", tmp_path / "done"
    script.write_text(_TICKER)
    agents = [
        _agent(settings, name, tmp_path / name, poll_interval=timedelta(seconds=0.2), stop_grace=timedelta(seconds=5))
        for name in ("node-a", "node-b")
    ]
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    http = httpx.Client(base_url=live_server, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        spec = {**SPEC, "entrypoint": str(script), "args": [str(done)], "rendezvous": {"last_call_timeout": 1}}
        job_id = http.post("/v1/jobs", json=spec, headers=admin).json()["id"]
        wait_for(lambda: all(a.runs(job_id, 1) for a in agents), 60, what="both torchruns running")

        received: list[bytes] = []
        ended = threading.Event()

        def follow() -> None:
            with http.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, timeout=None) as resp:
                assert resp.status_code == 200
                for chunk in resp.iter_raw():
                    received.append(chunk)
            ended.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        wait_for(
            lambda: all(f"[{n}] tick 5 from {n}\n".encode() in b"".join(received) for n in ("node-a", "node-b")),
            60,
            what="both nodes' lines streamed",
        )
        assert not ended.is_set()

        def agent_streams() -> int:
            """Connections the two agents' log servers serve now (not threads by name: other tests' servers in
            this process may have some of their own)."""
            return sum(a.log_server.open_connections for a in agents if a.log_server is not None)

        assert agent_streams() == 2  # the follower's, one on each agent
        with http.stream(
            "GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true", "node": "node-a"}, timeout=None
        ) as other:
            assert other.status_code == 200 and other.headers["x-etrain-node"] == "node-a"
            assert next(other.iter_raw()).startswith(b"+ ")  # a single node's log comes as it is
            wait_for(lambda: _exactly(agent_streams(), 3), 10, what="a third stream", retry_on=(ValueError,))
        # that client hung up: the controller lets go of the agent's stream, the agent of the file
        wait_for(lambda: agent_streams() == 2, 10, what="the hung-up follower's stream to end")
        assert not ended.is_set()
        done.touch()  # the workers finish: the job succeeds, the stream ends
        assert ended.wait(60), "the followed logs did not end with the job"
        text = b"".join(received).decode()
        lines = text.splitlines()
        assert all(line.startswith(("[node-a] ", "[node-b] ")) for line in lines), lines[:5]
        for n in ("node-a", "node-b"):
            ticks = [int(line.split()[2]) for line in lines if line.startswith(f"[{n}] tick ")]
            assert ticks == sorted(ticks) and len(ticks) > 5  # in order, none twice
            assert f"[{n}] bye from {n}" in lines
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded", 60, what="succeeded")
        # the job has ended: its logs stay readable (the agents keep the files)
        after = http.get(f"/v1/jobs/{job_id}/logs")
        assert after.status_code == 200 and "bye from node-b" in after.text
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        http.close()


def _exactly(value: int, expected: int) -> bool:
    """``value == expected``, else a ValueError naming ``value`` (``wait_for`` reports the last one on timeout)."""
    if value != expected:
        raise ValueError(f"{value}, not {expected}")
    return True
