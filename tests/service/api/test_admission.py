"""Requests are admitted before their bodies are read: a size limit and, under /v1/, authentication first."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api.admission import DEFAULT_MAX_BODY_BYTES
from tests.service.conftest import ADMIN, READER

pytestmark = pytest.mark.timeout(60)

NO_TOKEN = {"Authorization": ""}


def test_malformed_json_without_a_token_is_401_not_422(api: TestClient) -> None:
    resp = api.post("/v1/jobs", content=b"{not json", headers={**NO_TOKEN, "Content-Type": "application/json"})
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"


def test_a_huge_body_without_a_token_is_refused_before_it_is_parsed(api: TestClient) -> None:
    body = b"[" + b"1," * (15 << 20) + b"1]"  # 30 MiB of valid JSON
    resp = api.post("/v1/jobs", content=body, headers={**NO_TOKEN, "Content-Type": "application/json"})
    assert resp.status_code == 401


def test_a_body_over_the_limit_is_413_even_with_an_admin_token(api: TestClient) -> None:
    spec = {"name": "big", "entrypoint": "t.py", "env": {"X": "y" * (2 << 20)}}  # a 2 MiB env
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 413
    assert resp.json()["detail"] == f"request body larger than {DEFAULT_MAX_BODY_BYTES} bytes"
    assert api.get("/v1/jobs").json()["jobs"] == []  # nothing was stored


def test_a_streamed_body_without_length_is_cut_off_at_the_limit(api: TestClient) -> None:

    def chunks() -> Iterator[bytes]:
        yield b'{"name": "big", "entrypoint": "t.py", "env": {"X": "'
        for _ in range(64):  # 4 MiB in 64 KiB chunks, no Content-Length (chunked)
            yield b"y" * (64 << 10)
        yield b'"}}'

    resp = api.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert "larger than" in resp.json()["detail"]


def test_a_body_within_the_limit_is_admitted(api: TestClient) -> None:
    spec = {"name": "ok", "entrypoint": "t.py", "env": {"X": "y" * 1000}}
    resp = api.post(
        "/v1/jobs",
        content=json.dumps(spec),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    assert resp.status_code == 201, resp.text


def test_read_tokens_see_env_keys_but_not_values_nor_log_tails(api: TestClient) -> None:

    spec = {"name": "s", "entrypoint": "t.py", "env": {"WANDB_API_KEY": "sk-secret-1"}}
    job = api.post("/v1/jobs", json=spec).json()
    assert job["spec"]["env"] == {"WANDB_API_KEY": "sk-secret-1"}  # the admin who submitted it
    seen = api.get(f"/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {READER}"}).json()
    assert seen["spec"]["env"] == {"WANDB_API_KEY": "<redacted>"}
    assert "sk-secret-1" not in json.dumps(api.get("/v1/jobs", headers={"Authorization": f"Bearer {READER}"}).json())


def test_metrics_name_jobs_so_they_need_a_read_token(api: TestClient) -> None:

    assert api.get("/metrics", headers=NO_TOKEN).status_code == 401
    assert api.get("/metrics", headers={"Authorization": f"Bearer {READER}"}).status_code == 200
