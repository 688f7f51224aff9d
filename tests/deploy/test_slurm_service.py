"""The job service on a real Slurm (``tests/deploy/slurm.py``): ``sbatch scripts/hpc/slurm-agents.sh`` on 3 nodes
brings up 3 agents of a real controller; a job submitted through the API runs on the 3 nodes; one node is lost
(its slurmd, its agent, its torchrun and workers SIGKILLed): the allocation survives, the job re-forms on 2 nodes
and finishes. Then ``scancel`` ends the allocation while a second job runs: the agents stop, the job's workers save
on the signal, and the controller's status names that snapshot."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.prefork.common import worker_tree
from service.testing.cluster import LocalServiceCluster
from tests.deploy.conftest import REPO
from tests.deploy.slurm import LocalSlurm, missing
from tests.integration.service_harness import job_spec, wait_api

pytestmark = pytest.mark.timeout(420)

HPC = REPO / "scripts" / "hpc"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LocalServiceCluster]:
    cluster = LocalServiceCluster(tmp_path / "service")
    try:
        yield cluster
    finally:
        cluster.stop()


def _agent_pids(node: str) -> list[int]:
    """The agent of ``node`` (its environment names Slurm's node) and the slurmstepd above it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not (entry.name.isascii() and entry.name.isdigit()):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in environ and b"agent" in cmdline:
            pids += [int(entry.name), int(stat.rsplit(")", 1)[1].split()[1])]
    return pids


def test_a_service_job_on_slurm_survives_a_lost_node_and_saves_on_scancel(
    service: LocalServiceCluster, tmp_path: Path
) -> None:
    problem = missing()
    if problem:
        pytest.fail(problem)
    api = service.start_controller()
    # message_timeout=3: the lost node is DOWN before the scancel, whose job would otherwise wait for it to be
    slurm = LocalSlurm(tmp_path / "slurm", slurmd_timeout=6, message_timeout=3).start()
    try:
        env = {
            "ETRAIN_ETCD_ENDPOINTS": service.etcd.endpoints,
            "ETRAIN_PREFIX": service.prefix,
            "ETRAIN_BIN": str(Path(sys.executable).parent / "etrain"),
            "ETRAIN_NPROC_PER_NODE": "1",
            "ETRAIN_CONTROLLER_URL": service.url,
            "TMPDIR": str(tmp_path),
            # the lease of the test cluster's own agents (2 s, not 10): the lost node's agent is gone sooner
            "ETRAIN_AGENT_ARGS": f"--lease-ttl {service.lease_ttl}",
        }
        out = tmp_path / "agents-%j.out"
        allocation = slurm.sbatch("--nodes=3", f"--output={out}", str(HPC / "slurm-agents.sh"), env=env, cwd=REPO)
        log = Path(str(out).replace("%j", allocation))

        def output() -> str:
            return log.read_text()[-3000:] if log.exists() else "(no output)"

        wait_api("3 agents", lambda: sorted(n["name"] for n in api.nodes()) == slurm.names, 90)
        job_id = api.submit(job_spec(120, step_time=0.1))["id"]
        wait_api(
            "the job at 3 nodes with a snapshot",
            lambda: (j := api.job(job_id))["world_size"]["current"] == 3 and (j["checkpoint"]["step"] or 0) >= 10,
            150,
        )
        report = service.reports(job_id)["n3"]
        workers = [pid for pid, _ in worker_tree(report.pid)] if report.pid else []
        lost_at = time.monotonic()
        slurm.kill_node("n3", [*_agent_pids("n3"), *([report.pid] if report.pid else []), *workers])
        wait_api(
            "the job on 2 nodes",
            lambda: (
                (j := api.job(job_id))["world_size"]["current"] == 2
                and j["state"] == "running"
                and "n3" not in j["nodes"]
            ),
            120,
        )
        reformed_s = time.monotonic() - lost_at
        final = wait_api(
            "the job to finish", lambda: (j := api.job(job_id))["state"] in ("succeeded", "failed") and j, 240
        )
        assert final["state"] == "succeeded", final["last_error"]
        assert slurm.job_state(allocation) == "RUNNING", output()  # the allocation survived the node
        print(f"service on Slurm: node lost -> the job running at 2 nodes after {reformed_s:.1f} s")

        # the allocation ends (scancel; a time limit does the same) while a job runs: it saves on the signal
        second = api.submit({**job_spec(100_000, step_time=0.1, min_nodes=1, max_nodes=2), "name": "second"})["id"]
        wait_api(
            "the second job running",
            lambda: (j := api.job(second))["state"] == "running" and (j["progress"]["step"] or 0) >= 5,
            120,
        )
        slurm.scancel(allocation)
        wait_api("the agents gone", lambda: not api.nodes(), 60)
        stopped = wait_api("the second job stopped", lambda: (j := api.job(second))["state"] != "running" and j, 60)
        assert stopped["checkpoint"]["step"] == stopped["progress"]["step"], (
            f"the snapshot written on the signal is the one the status names: {stopped['checkpoint']} "
            f"{stopped['progress']}"
        )
        lost = [e for e in api.events(second) if e["type"] == "node_lost"]
        assert lost and all("planned" in e["message"] for e in lost), lost  # a planned stop, not a lost node
        assert stopped["restarts"]["failure"] == 0 and stopped["restarts"]["membership"] == 0, stopped["restarts"]
    finally:
        slurm.stop()
