"""A job's metric series through the service: the leader records the reports, ``GET /v1/jobs/{id}/metrics`` and
``etrain metrics`` return them from the job's first report, Prometheus has the latest loss and steps/s (real
etcd, the reconcile loop running)."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastic.contract.progress import Progress
from elastic.etcd import EtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster
from elastic.testing.wait import wait_for
from service.cli.main import main
from service.core.config import Settings
from service.core.keys import Keys
from tests.service.conftest import ADMIN, READER, make_settings

pytestmark = pytest.mark.timeout(90)

T0 = 1_764_000_000.0


@pytest.fixture
def settings(etcd_server: LocalEtcdCluster, key_prefix: str, tmp_path: Path) -> Settings:
    return make_settings(
        etcd_server,
        key_prefix,
        checkpoint_root=f"file://{tmp_path}/ckpt",
        metrics_flush_interval=timedelta(seconds=0.2),
    )


def _submit(api: TestClient) -> str:
    resp = api.post("/v1/jobs", json={"name": "curve", "entrypoint": "train.py"})
    assert resp.status_code == 201, resp.text
    job_id: str = resp.json()["id"]
    return job_id


def _report(api: TestClient, etcd_client: EtcdClient, key_prefix: str, job_id: str, i: int, **kw: Any) -> None:
    """Write report ``i`` (step 10*i, a second apart) and wait until the leader has taken it in."""
    progress = Progress(
        step=10 * i, world_size=kw.pop("world_size", 2), time=T0 + i, loss=1.0 / (i + 1), generation=1, **kw
    )
    etcd_client.put(Keys(key_prefix).progress_of(job_id), progress.to_json())
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 10 * i, timeout=20)


def _series(api: TestClient, job_id: str, query: str = "", token: str = READER) -> dict[str, Any]:
    resp = api.get(f"/v1/jobs/{job_id}/metrics{query}", headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_metrics_api_returns_every_report_from_the_jobs_start_to_a_read_token(
    api: TestClient, etcd_client: EtcdClient, key_prefix: str
) -> None:
    job_id = _submit(api)
    for i in range(6):
        _report(api, etcd_client, key_prefix, job_id, i, world_size=2 if i < 3 else 1, checkpoint_step=10 * i)
    wait_for(lambda: _series(api, job_id)["count"] == 6, timeout=20)
    body = _series(api, job_id)
    assert body["windows"] == []
    points = body["points"]
    assert [p["step"] for p in points] == [0, 10, 20, 30, 40, 50]
    assert [p["world_size"] for p in points] == [2, 2, 2, 1, 1, 1]
    assert points[0]["loss"] == 1.0 and points[0]["t"] == T0
    assert points[0].get("steps_per_s") is None and points[1]["steps_per_s"] == pytest.approx(10.0)
    assert [p["step"] for p in _series(api, job_id, f"?since={T0 + 3}")["points"]] == [40, 50]
    fitted = _series(api, job_id, "?max_points=2")
    assert len(fitted["windows"]) + len(fitted["points"]) <= 2
    assert sum(w["n"] for w in fitted["windows"]) + len(fitted["points"]) == 6
    assert fitted["windows"][0]["loss"] == [1.0, pytest.approx(1 / 3), pytest.approx(1 / 3), 1.0]

    assert api.get(f"/v1/jobs/{job_id}/metrics", headers={"Authorization": ""}).status_code == 401
    assert api.get("/v1/jobs/nope-1/metrics").status_code == 404
    assert api.get(f"/v1/jobs/{job_id}/metrics?max_points=1").status_code == 422

    text = api.get("/metrics").text
    assert f'etrain_job_loss{{job="{job_id}"}} {1 / 6!r}' in text
    assert f'etrain_job_steps_per_second{{job="{job_id}"}} 10.0' in text


def test_a_malformed_report_does_not_enter_the_served_series(
    api: TestClient, etcd_client: EtcdClient, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = _submit(api), _submit(api)
    _report(api, etcd_client, key_prefix, good, 0)
    etcd_client.put(Keys(key_prefix).progress_of(bad), b'{"step": "many", "world_size": 1, "time": 1}')
    _report(api, etcd_client, key_prefix, good, 1)
    wait_for(lambda: _series(api, good)["count"] == 2, timeout=20)
    assert _series(api, bad) == {"job_id": bad, "count": 0, "windows": [], "points": []}
    assert f"job {bad}: ignoring its invalid progress report" in caplog.text


def test_etrain_metrics_prints_the_series_as_a_table_and_as_csv(
    api: TestClient,
    live_server: str,
    etcd_client: EtcdClient,
    key_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = _submit(api)
    for i in range(3):
        _report(api, etcd_client, key_prefix, job_id, i)
    wait_for(lambda: _series(api, job_id)["count"] == 3, timeout=20)
    token = tmp_path / "token"
    token.write_text(READER + "\n")
    common = ["--server", live_server, "--token-file", str(token)]
    assert main(["metrics", job_id, *common]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["TIME", "REPORTS", "STEP"]
    assert [line.split()[2] for line in table[1:]] == ["0", "10", "20"]
    assert table[1].startswith("2025-11-24T16:00:00.000Z")
    assert main(["metrics", job_id, "--csv", *common]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["step"], r["loss"], r["world_size"], r["steps_per_s"]) for r in rows] == [
        ("0", "1", "2", ""),
        ("10", "0.5", "2", "10"),
        ("20", "0.333333", "2", "10"),
    ]
    assert main(["metrics", job_id, "--csv", "--max-points", "2", *common]) == 0  # older reports as a window
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["reports"], r["step"], r["loss"], r["loss_min"], r["loss_max"]) for r in rows] == [
        ("2", "10", "0.5", "0.5", "1"),
        ("1", "20", "0.333333", "0.333333", "0.333333"),
    ]
    assert main(["metrics", job_id, "--max-points", "2", *common]) == 0
    assert "0.5..1" in capsys.readouterr().out.splitlines()[1]
    assert main(["metrics", job_id, "--since", str(T0 + 1), "--json", *common]) == 0
    assert '"step": 20' in capsys.readouterr().out
    assert main(["metrics", "nope-1", *common]) == 3
    assert "HTTP 404" in capsys.readouterr().err
    assert ADMIN not in " ".join(common)  # a read token is enough
