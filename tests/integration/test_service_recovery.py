"""A job on three real agents survives a SIGKILLed agent and a SIGKILLed controller, and finishes.

Real etcd, the controller and the agents as ``etrain`` processes, stock torchrun with the etcd-v3
rendezvous, the example job training with gloo on CPU and checkpointing.
"""

from __future__ import annotations

import json

import pytest

from elastic.checkpoint import create_checkpoint_manager
from service.core.trace import validate_trace
from service.testing.cluster import LocalServiceCluster
from tests.integration.service_harness import job_spec, wait_api

pytestmark = pytest.mark.timeout(240)

STEPS = 150


def test_job_recovers_from_agent_sigkill_and_controller_restart_then_finishes(
    cluster: LocalServiceCluster,
) -> None:
    api = cluster.start_controller()
    for name in ("node-1", "node-2", "node-3"):
        cluster.start_agent(name)
    wait_api("3 nodes", lambda: len(api.nodes()) == 3, 60)
    job_id = api.submit(job_spec(STEPS))["id"]

    def at_three_with_checkpoint() -> bool:
        job = api.job(job_id)
        return job["world_size"]["current"] == 3 and (job["checkpoint"]["step"] or 0) >= 10

    wait_api("world size 3 and a checkpoint", at_three_with_checkpoint, 120)
    victim = api.job(job_id)["nodes"][-1]
    cluster.kill_agent(victim)

    def reformed_on_two() -> dict | None:
        job = api.job(job_id)
        ok = len(job["nodes"]) == 2 and job["world_size"]["current"] == 2 and job["state"] == "running"
        return job if ok else None

    before = wait_api("the job to re-form on 2 nodes", reformed_on_two, 90)
    assert victim not in before["nodes"] and before["generation"] == 1  # re-formed in place
    history = before["world_size"]["history"]
    assert [h["world_size"] for h in history][-1] == 2 and victim not in history[-1]["nodes"], history
    assert before["restarts"]["membership"] == 1 and before["restarts"]["failure"] == 0

    cluster.kill_controller()
    api = cluster.start_controller()  # a new process, new port: everything comes from etcd
    after = api.job(job_id)
    assert after["state"] == "running" and after["progress"]["step"] < STEPS  # the job trained on meanwhile
    assert after["world_size"]["history"][: len(before["world_size"]["history"])] == before["world_size"]["history"]
    assert after["restarts"] == before["restarts"] and after["created_at"] == before["created_at"]
    types = [e["type"] for e in api.events(job_id)]
    assert types[0] == "submitted" and "node_lost" in types

    final = wait_api("the job to finish", lambda: (j := api.job(job_id))["state"] in ("succeeded", "failed") and j, 150)
    assert final["state"] == "succeeded", final["last_error"]
    sizes = [c["world_size"] for c in final["world_size"]["history"]]
    assert 3 in sizes and sizes[-1] == 2
    assert final["checkpoint"]["step"] == STEPS and final["progress"]["step"] == STEPS
    assert final["restarts"]["failure"] == 0 and final["generation"] == 1
    ckpt_dir = cluster.checkpoint_root / job_id
    assert final["checkpoint"]["url"] == f"file://{ckpt_dir}"
    snapshot = create_checkpoint_manager(str(ckpt_dir)).load_latest()  # verified (sizes, sha256)
    assert snapshot is not None and snapshot.step == STEPS
    # signed with the job's own key, which the API never shows
    assert all("manifest_hmac" in json.loads(m.read_text()) for m in ckpt_dir.glob("step-*/manifest.json"))
    assert "checkpoint_key" not in json.dumps(final) and "checkpoint_key" not in json.dumps(api.events(job_id))

    # the timeline of the run: valid Chrome trace JSON, the killed node's generation ends with its loss, and
    # the survivors re-form until the smaller world reports
    trace = api.trace(job_id)
    assert validate_trace(trace) == [], validate_trace(trace)[:5]
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    on = [e for e in trace["traceEvents"] if e.get("tid") == tids[f"node {victim}"]]
    assert [e["name"] for e in on if e["ph"] == "i"].count("node lost") == 1
    assert any(e["ph"] == "X" and e["name"] == "generation 1" and e["args"]["ended"] == "node lost" for e in on)
    survivor = before["nodes"][0]
    reforms = [e for e in trace["traceEvents"] if e.get("tid") == tids[f"node {survivor}"] and e["name"] == "re-form"]
    assert reforms and reforms[0]["args"]["outcome"] == "resumed", reforms
