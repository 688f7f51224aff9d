"""``etrain logs JOB -f`` (the CLI as a process, an admin token from the environment) follows a job training on two
agents of a whole local service (etcd, the controller with tokens, agents serving their logs): it prints the
workers' lines while they train and exits 0 once the job has ended."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from service.testing.cluster import REPO, LocalServiceCluster
from tests.integration.service_harness import job_spec, wait_api
from tests.service.conftest import ADMIN, READER
from tests.service.ui.conftest import start_controller_with_tokens

pytestmark = pytest.mark.timeout(120)


def test_logs_follow_prints_lines_while_the_job_trains_and_exits_when_it_ends(cluster: LocalServiceCluster) -> None:
    api = start_controller_with_tokens(cluster, {ADMIN: "admin", READER: "read"})
    for name in ("node-1", "node-2"):
        cluster.start_agent(name)
    wait_api("2 nodes", lambda: len(api.nodes()) == 2, 60)
    job_id = api.submit(job_spec(60, step_time=0.1, min_nodes=2, max_nodes=2))["id"]
    wait_api(
        "both torchruns to run",
        lambda: (
            len(cluster.reports(job_id)) == 2 and all(r.state == "running" for r in cluster.reports(job_id).values())
        ),
        60,
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith("ETRAIN_")}
    env.update(ETRAIN_TOKEN=ADMIN, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "logs", job_id, "-f", "--server", cluster.url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace").rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # lines come while the job trains: a worker's progress logged after the follow began, job not yet ended
        wait_api("a training line", lambda: any("world size 2" in line for line in lines), 60)
        assert api.job(job_id)["state"] not in ("succeeded", "failed", "cancelled")
        assert proc.poll() is None
        assert proc.wait(timeout=90) == 0, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    text = list(lines)
    assert all(line.startswith(("[node-1] ", "[node-2] ")) for line in text), text[:5]
    assert any(line.startswith("[node-1] ") for line in text) and any(line.startswith("[node-2] ") for line in text)
    assert any("finished at step 60" in line for line in text)  # the last lines, written as the workers ended
    wait_api("the job to succeed", lambda: api.job(job_id)["state"] == "succeeded", 60)
