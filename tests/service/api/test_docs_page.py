"""``/docs`` as the controller serves it (no browser; ``tests/service/ui/test_docs_browser.py`` renders it): Swagger UI
from the controller's own origin, never a CDN, under a strict Content-Security-Policy, since the page shares its origin
with the dashboard, whose tab keeps the API token in ``sessionStorage``; ReDoc (a CDN's script too) is off."""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urljoin

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.core.config import EtcdOptions, Role, Settings, TokenEntry
from tests.service.conftest import READER

pytestmark = pytest.mark.timeout(30)

BASE = "http://testserver"


@pytest.fixture
def client() -> Iterator[TestClient]:
    # nothing here touches etcd: the app is built against an address nobody listens on, its loop not started
    app = create_app(
        Settings(etcd=EtcdOptions("127.0.0.1:1"), tokens=(TokenEntry(READER, Role.READ, "bob"),), run_controller=False)
    )
    yield TestClient(app, base_url=BASE)


def _csp(headers: object) -> dict[str, list[str]]:
    policy = headers["content-security-policy"]  # type: ignore[index]
    return {d.split()[0]: d.split()[1:] for d in policy.split("; ")}


def _assert_strict(resp: object) -> None:
    csp = _csp(resp.headers)  # type: ignore[attr-defined]
    assert csp["default-src"] == ["'none'"] and csp["script-src"] == ["'self'"], csp
    assert csp["connect-src"] == ["'self'"] and csp["style-src"] == ["'self'"], csp
    assert csp["frame-ancestors"] == ["'none'"] and csp["object-src"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    allowed = {v for values in csp.values() for v in values}
    assert allowed <= {"'self'", "'none'", "data:"}, allowed  # no other host, nothing 'unsafe-...'
    assert resp.headers["x-content-type-options"] == "nosniff"  # type: ignore[attr-defined]
    assert resp.headers["x-frame-options"] == "DENY"  # type: ignore[attr-defined]


def _references(html: str) -> list[str]:
    return re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']*)["']""", html)


def test_the_docs_page_references_only_its_own_origin_and_has_no_inline_script(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    _assert_strict(page)
    refs = _references(page.text)
    assert refs, page.text
    for ref in refs:
        assert urljoin(f"{BASE}/docs", ref).startswith(f"{BASE}/docs/"), ref  # relative, below /docs
    assert "//" not in "".join(refs) and "cdn" not in page.text.lower()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", page.text, re.S)
    assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+=", page.text) and "<style" not in page.text


def test_every_file_the_docs_page_names_is_served_from_here_under_the_strict_policy(client: TestClient) -> None:
    page = client.get("/docs").text
    kinds = {}
    for ref in _references(page):
        resp = client.get(urljoin(f"{BASE}/docs", ref))
        assert resp.status_code == 200, ref
        _assert_strict(resp)
        kinds[ref.rsplit("/", 1)[-1]] = resp.headers["content-type"].split(";")[0]
    assert kinds == {
        "swagger-ui.css": "text/css",
        "favicon-32x32.png": "image/png",
        "swagger-ui-bundle.js": "text/javascript",
        "init.js": "text/javascript",
    }
    bundle = client.get("/docs/swagger-ui-bundle.js")
    assert len(bundle.content) > 500_000 and b"SwaggerUIBundle" in bundle.content
    init = client.get("/docs/init.js").text
    assert '"openapi.json"' in init and "validatorUrl: null" in init and "http" not in init
    assert client.get("/openapi.json").json()["info"]["title"] == "etrain"


def test_redoc_the_oauth_redirect_and_any_other_docs_path_are_not_served(client: TestClient) -> None:
    for path in (
        "/redoc",
        "/docs/oauth2-redirect",
        "/docs/swagger-ui-bundle.js.map",
        "/docs/index.html",
        "/docs/..%2F..%2Fapp.py",
        "/docs/%2e%2e/dashboard.py",
        "/docs/swagger-initializer.js",
    ):
        assert client.get(path).status_code == 404, path


def test_the_dashboard_runs_no_script_from_another_origin_either(client: TestClient) -> None:
    csp = _csp(client.get("/ui/").headers)
    assert csp["script-src"] == ["'self'"] and csp["default-src"] == ["'self'"]
