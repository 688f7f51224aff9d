"""The dashboard's files as the controller serves them (no browser): public static shell, strict headers,
only its own files, nothing from another host, and the API behind it still demanding a token."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.dashboard import ASSET_DIR, ASSETS
from service.core.config import EtcdOptions, Role, Settings, TokenEntry
from tests.service.conftest import READER

TOKENS = (TokenEntry(READER, Role.READ, "bob"),)


@pytest.fixture
def client() -> Iterator[TestClient]:
    # nothing here touches etcd: the app is built against an address nobody listens on, its loop not started
    app = create_app(Settings(etcd=EtcdOptions("127.0.0.1:1"), tokens=TOKENS, run_controller=False))
    yield TestClient(app)


@pytest.mark.timeout(30)
def test_ui_redirects_to_the_shell_which_needs_no_token(client: TestClient) -> None:
    resp = client.get("/ui", follow_redirects=False)
    assert resp.status_code == 308 and resp.headers["location"] == "ui/"  # relative: works under a path prefix
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="token-input"' in page.text and 'type="password"' in page.text
    # the data stays behind the token
    assert client.get("/v1/jobs").status_code == 401


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ASSETS))
def test_every_ui_response_carries_a_strict_csp_and_no_sniff_headers(client: TestClient, name: str) -> None:
    resp = client.get(f"/ui/{name}")
    assert resp.status_code == 200, name
    csp = {d.split()[0]: d.split()[1:] for d in resp.headers["content-security-policy"].split("; ")}
    assert csp["default-src"] == ["'self'"] and csp["script-src"] == ["'self'"] and csp["style-src"] == ["'self'"]
    assert csp["connect-src"] == ["'self'"] and csp["frame-ancestors"] == ["'none'"]
    assert csp["form-action"] == ["'none'"] and csp["object-src"] == ["'none'"]
    assert not any("unsafe" in v for values in csp.values() for v in values)
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"
    assert resp.headers["x-frame-options"] == "DENY"
    assert "set-cookie" not in resp.headers


@pytest.mark.timeout(30)
def test_shell_has_no_inline_script_or_style_and_the_token_field_is_never_submitted(client: TestClient) -> None:
    html = client.get("/ui/").text
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert "<style" not in html and "style=" not in html and not re.search(r"\son[a-z]+=", html)
    token_input = re.search(r"<input[^>]*id=\"token-input\"[^>]*>", html)
    assert token_input and "name=" not in token_input.group(0)  # a submitted form would carry no token
    assert "action=" not in html


@pytest.mark.timeout(30)
def test_dashboard_files_fetch_nothing_from_another_host() -> None:
    for filename, _ in ASSETS.values():
        text = (ASSET_DIR / filename).read_text()
        urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s\"'`)]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (filename, urls)  # the SVG namespace is a name, not a fetch
    modules = [filename for filename, _ in ASSETS.values() if filename.endswith(".js")]
    assert "dashboard.js" in modules
    for filename in modules:
        js = (ASSET_DIR / filename).read_text()
        assert "innerHTML" not in js and "eval(" not in js and "document.write" not in js, filename
        assert "localStorage" not in js and "document.cookie" not in js, filename  # the token: sessionStorage only


@pytest.mark.timeout(30)
def test_every_module_the_dashboard_imports_is_served() -> None:
    served = set(ASSETS)
    for filename, _ in ASSETS.values():
        if filename.endswith(".js"):
            for imported in re.findall(r'^import .* from "\./([^"]+)";$', (ASSET_DIR / filename).read_text(), re.M):
                assert imported in served, (filename, imported)
    assert {p.name for p in ASSET_DIR.glob("*.js")} <= served  # no module left out of ASSETS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/ui/app.py", "/ui/..%2Fdashboard.py", "/ui/%2e%2e/app.py", "/ui/index.html/x"])
def test_ui_serves_only_its_own_files(client: TestClient, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 404, path
    assert "def " not in resp.text


@pytest.mark.timeout(30)
def test_ui_config_says_whether_the_api_wants_a_token(client: TestClient) -> None:
    assert client.get("/ui/config.json").json()["auth_required"] is True
    off = TestClient(create_app(Settings(etcd=EtcdOptions("127.0.0.1:1"), tokens=None, run_controller=False)))
    assert off.get("/ui/config.json").json()["auth_required"] is False
