"""Cancelling a running job stops every torchrun and every worker on every node; the agents stay up."""

from __future__ import annotations

import pytest

from elastic.proctree import alive
from service.testing.cluster import LocalServiceCluster
from tests.integration.service_harness import job_spec, wait_api

pytestmark = pytest.mark.timeout(180)


def test_cancel_stops_all_workers_on_all_nodes(cluster: LocalServiceCluster) -> None:
    api = cluster.start_controller()
    for name in ("node-1", "node-2", "node-3"):
        cluster.start_agent(name)
    wait_api("3 nodes", lambda: len(api.nodes()) == 3, 60)
    job_id = api.submit(job_spec(100_000, step_time=0.2))["id"]
    wait_api("training at world size 3", lambda: api.job(job_id)["world_size"]["current"] == 3, 120)

    procs = cluster.job_processes(job_id)
    torchruns = [r.pid for r in cluster.reports(job_id).values() if r.state == "running"]
    assert len(torchruns) == 3
    assert len(procs) >= 6, procs  # 3 torchruns, each with at least its worker
    assert all(alive(*p) for p in procs)

    resp = api.cancel(job_id)
    assert resp["cancel_requested"] is True
    wait_api("the job to be cancelled", lambda: api.job(job_id)["state"] == "cancelled", 30)
    wait_api("every torchrun and worker to exit", lambda: not any(alive(*p) for p in procs), 30)

    reports = cluster.reports(job_id)
    assert reports == {} or all(r.state == "stopped" for r in reports.values())
    assert [n["name"] for n in api.nodes()] == ["node-1", "node-2", "node-3"]  # the agents stay
    assert all(p.poll() is None for p in cluster.agents.values())
    assert all(n["jobs"] == [] and n["free"] == 1 for n in api.nodes())
    types = [e["type"] for e in api.events(job_id)]
    assert "cancel_requested" in types and types[-1] == "state"
