"""The dashboard against a whole service on this machine with a real job: etcd, the controller (with tokens) and
two agents as ``etrain`` processes, stock torchrun running examples/demo_job.py. The jobs page shows the running
job, the nodes page its nodes, and the job page the world size dropping 2 -> 1 after an agent is SIGKILLed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic.testing.wait import wait_for
from service.testing.cluster import REPO, LocalServiceCluster
from tests.service.conftest import ADMIN, READER
from tests.service.ui.conftest import UiPage, browser_missing, start_controller_with_tokens

# one worker runs the module, in order: its tests share the module's job, and the last one kills an agent
pytestmark = pytest.mark.xdist_group("dashboard_cluster")
DEMO_JOB = REPO / "examples" / "demo_job.py"
# never finishes within a test: the cluster is stopped under it
SPEC: dict[str, Any] = {
    "name": "ui-demo",
    "entrypoint": str(DEMO_JOB),
    "args": ["--steps", "100000", "--checkpoint-every", "20", "--step-time", "0.05"],
    "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
    "min_nodes": 1,
    "max_nodes": 2,
    "rendezvous": {"last_call_timeout": 1},
    "restart_policy": {"backoff_initial": 1},
}


@dataclass
class RunningJob:
    cluster: LocalServiceCluster
    api: Any
    job_id: str


@pytest.fixture(scope="module")
def running_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningJob]:
    """A job training on two agents at world size 2 (shared by this module's tests; the last one kills an agent)."""
    reason = browser_missing()
    if reason:
        pytest.skip(reason)
    cluster = LocalServiceCluster(tmp_path_factory.mktemp("ui-cluster"), shared_zygote=True)
    try:
        api = start_controller_with_tokens(cluster, {ADMIN: "admin", READER: "read"})
        for name in ("node-1", "node-2"):
            cluster.start_agent(name)
        wait_for(lambda: len(api.nodes()) == 2, 60, 0.5, what="2 nodes", retry_on=(Exception,))
        job_id = api.submit(SPEC)["id"]

        def training_on_two() -> bool:
            job = api.job(job_id)
            return (
                job["state"] == "running" and job["world_size"]["current"] == 2 and (job["progress"]["step"] or 0) > 0
            )

        wait_for(training_on_two, 90, 0.5, what="the job to train at world size 2", retry_on=(Exception,))
        yield RunningJob(cluster, api, job_id)
    finally:
        cluster.stop()


@pytest.mark.timeout(150)
def test_jobs_page_shows_the_running_job_with_world_size_and_progress(ui: UiPage, running_job: RunningJob) -> None:
    url, job_id = running_job.cluster.url, running_job.job_id
    ui.sign_in(url, READER)
    row = ui.visible(f"tr[data-job-id='{job_id}'][data-state='running']")
    assert "running" in row.inner_text()
    assert row.locator("td.world-size").inner_text().startswith("2")
    first = ui.page.inner_text(f"tr[data-job-id='{job_id}'] .progress-text")
    assert first.endswith("/ 100000")
    # updated every few seconds without a reload
    ui.page.wait_for_function(
        "([id, first]) => document.querySelector(`tr[data-job-id='${id}'] .progress-text`).textContent !== first",
        arg=[job_id, first],
        timeout=15_000,
    )
    ui.shot("jobs-running")
    ui.page.click("#nav-nodes")
    for node in ("node-1", "node-2"):
        cell = ui.visible(f"tr[data-node='{node}'] td.node-jobs")
        assert job_id in cell.inner_text() and "running" in cell.inner_text()
    ui.shot("nodes")
    assert ui.console_errors == []


@pytest.mark.timeout(150)
def test_job_page_shows_the_world_size_drop_after_an_agent_is_killed(
    ui: UiPage, running_job: RunningJob, tmp_path: Path
) -> None:
    cluster, job_id = running_job.cluster, running_job.job_id
    ui.sign_in(cluster.url, ADMIN, route=f"#/jobs/{job_id}")  # logs: for the job's owner and admins
    ui.page.wait_for_function("() => document.querySelector('#world-size-current')?.textContent === '2'")
    # the job's logs, read from both agents through the controller, each node's section headed
    ui.page.wait_for_function("() => /==> node-2 \\(generation/.test(document.querySelector('#job-logs')?.textContent)")
    assert "==> node-1 (generation " in ui.page.inner_text("#job-logs")
    # (functions, not expressions: Playwright evaluates an expression with eval, which the page's CSP forbids)
    # the page reads the job's kept metric series and appends new reports: a few make the loss and steps/s curves
    ui.page.wait_for_function("() => Number(document.querySelector('#svg-rate')?.dataset.points) >= 2", timeout=30_000)
    ui.shot("job-world-size-2")
    victim = running_job.api.job(job_id)["nodes"][-1]
    cluster.kill_agent(victim)

    ui.page.wait_for_function(
        "() => document.querySelector('#world-size-current')?.textContent === '1'", timeout=60_000
    )
    ui.page.wait_for_function(
        "() => document.querySelector('#svg-world-size')?.dataset.values.endsWith('2,1')", timeout=10_000
    )
    assert "2 → 1" in ui.page.inner_text("#world-size-changes")
    ui.visible("#restarts-table tr[data-cause='membership'] td.count >> text='1'")
    ui.visible("#events-table tr[data-type='node_lost']")
    assert victim in ui.page.inner_text("#events-table tr[data-type='node_lost']")
    assert "step" in ui.page.inner_text("#checkpoint-latest")  # the newest committed checkpoint
    ui.shot("job-world-size-1")
    assert float(ui.page.get_attribute("#svg-loss", "data-points") or 0) >= 2
    assert ui.console_errors == []
