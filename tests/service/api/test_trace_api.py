"""``GET /v1/jobs/{id}/trace`` through the real app, its reconcile loop and a real etcd: a job placed on two
registered agents, a progress report with a committed checkpoint, one agent gone; the exported trace validates,
shows each node's track, and needs a token like the other job reads."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.contract.progress import Progress
from elastic.testing.wait import wait_for
from service.agent.node import create_agent
from service.core.config import AgentSettings, Settings
from service.core.store import ServiceStore
from service.core.trace import validate_trace
from tests.service.conftest import READER

SPEC: dict[str, Any] = {"name": "traced", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}


def _on(trace: dict[str, Any], thread: str, name: str) -> list[dict[str, Any]]:
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    return [e for e in trace["traceEvents"] if e["ph"] != "M" and e.get("tid") == tids[thread] and e["name"] == name]


@pytest.mark.timeout(60)
def test_trace_of_a_job_that_lost_an_agent_validates_and_puts_the_loss_on_that_nodes_track(
    api: TestClient, settings: Settings, tmp_path: Path
) -> None:
    agents = {
        name: create_agent(
            AgentSettings(
                etcd=settings.etcd,
                node_name=name,
                prefix=settings.prefix,
                nproc_per_node=1,
                work_dir=tmp_path / name,
                lease_ttl=timedelta(seconds=2),
            )
        )
        for name in ("node-a", "node-b")
    }
    for agent in agents.values():
        agent.register()  # no agent loop: the leader assigns, nothing is started
    try:
        job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["nodes"] == ["node-a", "node-b"], what="placed")
        store: ServiceStore = api.app.state.store  # type: ignore[attr-defined]
        ckpt = f"{settings.checkpoint_root}/{job_id}/step-10".removeprefix("file://")
        report = Progress(
            step=12,
            world_size=2,
            time=time.time(),
            loss=0.5,
            generation=1,
            checkpoint_step=10,
            checkpoint_path=ckpt,
            nodes=["node-a", "node-b"],
            extra={"snapshots_saved": 1, "last_save_seconds": 0.1},
        )
        store.client.put(store.keys.progress_of(job_id), report.to_json())  # as the job's rank 0 does
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["checkpoint"]["step"] == 10, what="checkpoint seen")
        agents.pop("node-b").shutdown()  # its lease revoked: the node is lost
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["nodes"] == ["node-a"], what="node-b dropped")

        path = f"/v1/jobs/{job_id}/trace"
        assert api.get(path, headers={"Authorization": ""}).status_code == 401
        assert api.get(path, headers={"Authorization": "Bearer not-a-token"}).status_code == 401
        assert api.get("/v1/jobs/nope-00000000/trace", headers={"Authorization": f"Bearer {READER}"}).status_code == 404
        resp = api.get(path, headers={"Authorization": f"Bearer {READER}"})  # a read token suffices
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        trace = resp.json()
        assert validate_trace(trace) == []
        threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert threads == {"controller", "snapshots", "node node-a", "node node-b"}
        [lost] = _on(trace, "node node-b", "node lost")
        [b_gen] = _on(trace, "node node-b", "generation 1")
        assert b_gen["args"]["ended"] == "node lost" and b_gen["ts"] + b_gen["dur"] == lost["ts"]
        [a_gen] = _on(trace, "node node-a", "generation 1")
        assert a_gen["args"]["ongoing"] is True and a_gen["ts"] == b_gen["ts"]  # both placed in one pass
        assert [e["args"]["step"] for e in _on(trace, "snapshots", "snapshot committed")] == [10]
        assert _on(trace, "snapshots", "snapshot committed")[0]["args"]["snapshot_stats"]["snapshots_saved"] == 1
        assert [e["args"]["value"] for e in trace["traceEvents"] if e["name"] == "world_size"] == [2]
        assert [e["args"]["value"] for e in trace["traceEvents"] if e["name"] == "loss"] == [0.5]
        assert trace["metadata"]["job_id"] == job_id and trace["metadata"]["notes"] == []
        assert "checkpoint_key" not in resp.text
        assert "/v1/jobs/{job_id}/trace" in api.get("/openapi.json").json()["paths"]
    finally:
        for agent in agents.values():
            agent.shutdown()
