"""The dashboard's "Over time" charts plot a job from its first report (real Chromium, real controller on the shared
etcd): reports made an hour before the page was opened are drawn, with world-size changes, restarts and
snapshots marked on the time axis, and the charts go on growing as new reports arrive."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_for
from service.core.config import Settings
from service.core.keys import Keys
from tests.service.conftest import ADMIN, READER, make_settings
from tests.service.ui.conftest import UiPage

pytestmark = pytest.mark.xdist_group("dashboard_browser")


@pytest.fixture
def settings(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Settings:
    return make_settings(
        etcd_server,
        key_prefix,
        checkpoint_root=f"file://{tmp_path}/ckpt",
        metrics_flush_interval=timedelta(seconds=0.2),
    )


def _count(url: str, job_id: str) -> int:
    resp = httpx.get(f"{url}/v1/jobs/{job_id}/metrics", headers={"Authorization": f"Bearer {READER}"})
    assert resp.status_code == 200, resp.text
    count: int = resp.json()["count"]
    return count


def _report(url: str, etcd_client: EtcdClient, key: str, job_id: str, i: int, at: float) -> None:
    """Report ``i``: world size 3 then 2 (from report 6), generation 1 then 2 (from report 9), a snapshot at
    reports 4 and 8; waits until the controller has it in the job's series."""
    progress = Progress(
        step=10 * i,
        world_size=3 if i < 6 else 2,
        time=at,
        loss=round(4.0 / (i + 1), 6),
        generation=1 if i < 9 else 2,
        checkpoint_step=(i // 4) * 40 or None,
    )
    etcd_client.put(key, progress.to_json())
    wait_for(lambda: _count(url, job_id) == i + 1, timeout=20)


@pytest.mark.timeout(120)
def test_job_page_plots_reports_made_before_it_was_opened_marks_changes_and_keeps_appending(
    ui: UiPage, live_server: str, etcd_client: EtcdClient, key_prefix: str
) -> None:
    resp = httpx.post(
        f"{live_server}/v1/jobs",
        json={"name": "history", "entrypoint": "train.py"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    key = Keys(key_prefix).progress_of(job_id)
    started = time.time() - 3600  # an hour of training before anyone looks
    for i in range(12):
        _report(live_server, etcd_client, key, job_id, i, started + 300 * i)

    ui.sign_in(live_server, READER, route=f"#/jobs/{job_id}")
    ui.page.wait_for_function("() => document.querySelector('.charts')?.dataset.reports === '12'", timeout=20_000)
    assert float(ui.page.get_attribute(".charts", "data-first") or 0) == pytest.approx(started)
    loss = ui.page.get_attribute("#svg-loss", "data-values") or ""
    assert loss.split(",")[:3] == ["4", "2", "1.33333"]  # the first reports, an hour old
    assert ui.page.get_attribute("#svg-loss", "data-points") == "12"
    assert ui.page.get_attribute("#svg-rate", "data-points") == "10"  # none at the start, none across the restart
    marks = (ui.page.get_attribute("#svg-loss", "data-marks") or "").split(",")
    assert sorted(marks) == ["restart", "snapshot", "snapshot", "world_size"]
    assert ui.page.locator("#svg-world-size line.mark-world_size").count() == 1
    assert "3 → 2" in ui.page.inner_text("#world-size-changes")
    ui.shot("history")

    _report(live_server, etcd_client, key, job_id, 12, time.time())  # a report after the page opened
    ui.page.wait_for_function("() => document.querySelector('.charts')?.dataset.reports === '13'", timeout=20_000)
    assert ui.page.get_attribute("#svg-loss", "data-points") == "13"
    assert ui.console_errors == []
