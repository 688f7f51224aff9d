"""The HPC scripts under a real Slurm (``tests/deploy/slurm.py``: munged, slurmctld and three slurmd on this
machine), with the real etcd and the real ``etrain agent``. Slurm missing is a failure that says what to install,
never a silent skip: ``scripts/setup.sh`` installs it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from service.core.keys import Keys
from tests.deploy.conftest import REPO
from tests.deploy.slurm import LocalSlurm, missing

pytestmark = pytest.mark.timeout(180)

HPC = REPO / "scripts" / "hpc"


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[LocalSlurm]:
    problem = missing()
    if problem:
        pytest.fail(problem)
    cluster = LocalSlurm(tmp_path / "slurm").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _registered(client: EtcdClient, prefix: str) -> set[str]:
    keys = Keys(prefix)
    kvs, _ = client.get_prefix(keys.nodes)
    return {kv.key[len(keys.nodes) :] for kv in kvs}


def _wait(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.5)
    return False


def test_slurm_agents_script_brings_up_one_agent_per_node_and_every_one_registers_then_leaves_on_scancel(
    slurm: LocalSlurm, etcd_server: LocalEtcdCluster, etcd_client: EtcdClient, key_prefix: str, tmp_path: Path
) -> None:
    """``sbatch --nodes=3 scripts/hpc/slurm-agents.sh`` as documented. Before, 1 agent of 3 registered: all three
    took the host's name (``node name '<host>' is registered by a live agent``), and the health port 8081 and the
    work dir would collide too whenever two agents share a host."""
    env = {
        "ETRAIN_ETCD_ENDPOINTS": etcd_server.endpoints,
        "ETRAIN_PREFIX": key_prefix,
        "ETRAIN_BIN": str(Path(sys.executable).parent / "etrain"),
        "ETRAIN_NPROC_PER_NODE": "1",
        "TMPDIR": str(tmp_path),
    }
    out = tmp_path / "agents-%j.out"
    job = slurm.sbatch("--nodes=3", f"--output={out}", str(HPC / "slurm-agents.sh"), env=env, cwd=REPO)
    log = Path(str(out).replace("%j", job))
    up = _wait(lambda: _registered(etcd_client, key_prefix) == set(slurm.names), 90)
    assert up, (
        f"registered: {sorted(_registered(etcd_client, key_prefix))}, job {slurm.job_state(job)}; "
        f"its output:\n{log.read_text() if log.exists() else '(none)'}"
    )
    work_dirs = sorted(p.name for p in tmp_path.glob(f"etrain-{job}-*"))
    assert work_dirs == [f"etrain-{job}-{n}" for n in slurm.names]  # one work dir per job and node
    slurm.scancel(job)  # the agents get SIGTERM: they stop, revoke their leases, and the nodes leave at once
    assert _wait(lambda: not _registered(etcd_client, key_prefix), 30), sorted(_registered(etcd_client, key_prefix))


# A node lost with the allocation and the other agents kept (--no-kill on sbatch and srun): test_slurm_service.py,
# where a job also re-forms on the nodes left and finishes.
