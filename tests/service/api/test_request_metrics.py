"""``etrain_http_requests_total`` cannot be grown by callers: made-up HTTP methods (unauthenticated, any number of
them) are all counted under the one ``method="other"`` label, so ``/metrics`` stays the same size."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.timeout(60)


def _series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("etrain_http_requests_total{")]


def test_made_up_methods_share_one_metrics_label(api: TestClient) -> None:
    api.get("/healthz")
    before = api.get("/metrics").text
    for i in range(300):
        resp = api.request(f"X{i:04d}", "/v1/jobs", headers={"Authorization": ""})
        assert resp.status_code in (401, 405)
        api.request(f"Y{i:04d}", "/no/such/path")
    text = api.get("/metrics").text
    methods = {m for line in _series(text) for m in re.findall(r'method="([^"]*)"', line)}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}, sorted(methods)[:10]
    assert "other" in methods
    other = [line for line in _series(text) if 'method="other"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in other) == 600
    assert len(_series(text)) <= len(_series(before)) + 4  # a few (route, status) pairs, not one per request
