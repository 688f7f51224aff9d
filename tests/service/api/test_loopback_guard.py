"""A controller without tokens on a loopback address answers only its own machine's clients, not web pages in a local
browser: a foreign ``Host`` (DNS rebinding) gets 403, and a state-changing request that is not JSON (a cross-site
form post, a bodiless ``fetch``) gets 415 and changes nothing; the CLI's client still does everything. With tokens,
or with ``--insecure`` on a non-loopback address, none of this applies. Real app, real etcd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from elastic.testing.etcd_server import LocalEtcdCluster
from service.api.app import create_app
from tests.service.conftest import make_settings

pytestmark = pytest.mark.timeout(60)

SPEC = {"name": "guarded", "entrypoint": "train.py"}


@pytest.fixture
def app_settings(etcd_server: LocalEtcdCluster, key_prefix: str) -> Iterator[object]:
    yield make_settings(etcd_server, key_prefix, tokens=None, host="127.0.0.1", run_controller=False)


def test_auth_off_on_loopback_refuses_foreign_hosts_and_non_json_writes(app_settings: object) -> None:
    app = create_app(app_settings)  # type: ignore[arg-type]
    with TestClient(app, base_url="http://127.0.0.1:8080") as local:
        job_id = local.post("/v1/jobs", json=SPEC).json()["id"]
        for host in ("evil.example:8080", "evil.example", "127.0.0.1.evil.example", "10.0.0.1:8080"):
            resp = local.get("/v1/jobs", headers={"Host": host})
            assert resp.status_code == 403 and "loopback" in resp.json()["detail"], (host, resp.text)
        for host in ("localhost:8080", "[::1]:8080", "127.0.0.2", "LOCALHOST"):
            assert local.get("/v1/jobs", headers={"Host": host}).status_code == 200, host

        # a cross-site form post, a bodiless fetch, a text/plain body: refused before anything happens
        form = local.post(f"/v1/jobs/{job_id}/cancel", data={"x": "1"})
        bare = local.post(f"/v1/jobs/{job_id}/cancel")
        text = local.post(
            "/v1/jobs", content=b'{"name": "x", "entrypoint": "t.py"}', headers={"Content-Type": "text/plain"}
        )
        for resp in (form, bare, text):
            assert resp.status_code == 415 and "application/json" in resp.json()["detail"], resp.text
        assert local.get(f"/v1/jobs/{job_id}").json()["cancel_requested"] is False
        assert len(local.get("/v1/jobs").json()["jobs"]) == 1

        # JSON requests (what the CLI's client sends) go through
        resp = local.post(f"/v1/jobs/{job_id}/cancel", headers={"Content-Type": "application/json"})
        assert resp.status_code == 202


def test_the_cli_client_passes_the_guard(app_settings: object) -> None:
    from service.client.rest import ApiClient

    app = create_app(app_settings)  # type: ignore[arg-type]
    with TestClient(app, base_url="http://127.0.0.1:8080") as local:
        client = ApiClient("http://127.0.0.1:8080")
        client.close()
        client._http = local  # the app in process, through the client's own calls
        job_id = client.submit(SPEC)["id"]
        assert client.cancel(job_id)["cancel_requested"] is True
        assert client.node_op("node-a", "cordon")["changed"] is True


def test_with_tokens_or_off_loopback_hosts_are_not_checked(etcd_server: LocalEtcdCluster, key_prefix: str) -> None:
    from tests.service.conftest import ADMIN

    with_tokens = make_settings(etcd_server, key_prefix, host="127.0.0.1", run_controller=False)
    insecure = make_settings(etcd_server, key_prefix, tokens=None, host="0.0.0.0", run_controller=False)
    for settings in (with_tokens, insecure):
        with TestClient(create_app(settings), base_url="http://controller.example") as client:
            resp = client.get("/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"})
            assert resp.status_code == 200


def test_is_loopback_host() -> None:
    from service.api.admission import is_loopback_host

    for host in ("127.0.0.1", "127.0.0.1:80", "localhost", "localhost:1", "[::1]", "[::1]:8080", "::1", "127.9.9.9"):
        assert is_loopback_host(host), host
    for host in ("", "evil", "evil:80", "10.0.0.1", "[::2]:1", "localhost.evil", "127.0.0.1.nip.io", "[::1"):
        assert not is_loopback_host(host), host
