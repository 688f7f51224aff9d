"""The dashboard in a real browser (Chromium through Playwright) against a real controller on the shared etcd:
the token prompt, a refused token, where the token is kept, every page without console errors, the trace link.

No agents here, so jobs stay pending; tests/service/ui/test_dashboard_cluster.py runs a real job.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from elastic.testing.etcd_server import LocalEtcdCluster
from tests.service.conftest import ADMIN, READER, make_settings
from tests.service.ui.conftest import UiPage, serve

pytestmark = pytest.mark.xdist_group("dashboard_browser")  # one worker, one browser (a module fixture)
SPEC: dict[str, Any] = {"name": "ui-train", "entrypoint": "train.py", "min_nodes": 1, "max_nodes": 2}


def _submit(url: str, spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


@pytest.mark.timeout(60)
def test_page_without_a_token_shows_the_token_prompt_and_no_data(ui: UiPage, live_server: str) -> None:
    _submit(live_server)
    ui.page.goto(f"{live_server}/ui/")
    ui.visible("#token-input")
    assert ui.page.is_visible("#login") and not ui.page.is_visible("#login-error")
    assert ui.page.locator("#jobs-table").count() == 0  # nothing was shown, nor asked for without a token
    ui.shot("token-prompt")
    assert ui.console_errors == []  # the shell asked /ui/config.json, not the API, whether a token is needed


@pytest.mark.timeout(60)
def test_wrong_token_shows_an_authentication_error_and_keeps_the_prompt(ui: UiPage, live_server: str) -> None:
    ui.page.goto(f"{live_server}/ui/")
    ui.page.fill("#token-input", "not-a-token")
    ui.page.click("#token-submit")
    error = ui.visible("#login-error")
    assert "Authentication failed" in error.inner_text() and "401" in error.inner_text()
    assert ui.page.is_visible("#token-input") and ui.page.locator("#jobs-table").count() == 0
    assert ui.page.evaluate("sessionStorage.getItem('etrain.token')") is None
    ui.shot("wrong-token")
    # a stored token the controller no longer accepts (revoked) sends the user back to the prompt, saying why
    ui.page.evaluate("sessionStorage.setItem('etrain.token', 'revoked-token')")
    ui.page.reload()
    error = ui.visible("#login-error")
    assert "refused the token" in error.inner_text()
    assert ui.page.evaluate("sessionStorage.getItem('etrain.token')") is None


@pytest.mark.timeout(60)
def test_read_token_signs_in_and_stays_out_of_urls_cookies_and_local_storage(ui: UiPage, live_server: str) -> None:
    job = _submit(live_server)
    requests: list[tuple[str, str | None]] = []
    ui.page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization"))))
    ui.sign_in(live_server, READER)
    row = ui.visible(f"tr[data-job-id='{job['id']}']")
    assert "pending" in row.inner_text()
    assert "signed in" in ui.page.inner_text("#auth-state")
    ui.page.reload()  # the tab keeps the token across reloads ...
    ui.visible(f"tr[data-job-id='{job['id']}']")
    assert ui.page.evaluate("sessionStorage.getItem('etrain.token')") == READER
    assert ui.page.evaluate("localStorage.length") == 0 and ui.page.context.cookies() == []
    api_calls = [(u, a) for u, a in requests if "/v1/" in u]
    assert api_calls and all(a == f"Bearer {READER}" for _, a in api_calls)
    assert not any(READER in u for u, _ in requests) and READER not in ui.page.url
    ui.page.click("#sign-out")  # ... until forgotten
    ui.visible("#token-input")
    assert ui.page.evaluate("sessionStorage.getItem('etrain.token')") is None


@pytest.mark.timeout(90)
def test_every_page_loads_without_console_errors(ui: UiPage, live_server: str) -> None:
    job = _submit(live_server)
    ui.sign_in(live_server, READER)
    ui.visible(f"tr[data-job-id='{job['id']}']")
    ui.shot("jobs")
    ui.page.click(f"tr[data-job-id='{job['id']}'] a")
    ui.visible("#job-head h1")
    ui.visible("#events-table tr[data-type='submitted']")
    assert ui.page.is_visible("#chart-loss svg") and ui.page.is_visible("#chart-world-size svg")
    words = ui.page.inner_text("main").split()
    assert "null" not in words and "undefined" not in words and "NaN" not in words
    assert "No logs yet" in ui.page.inner_text("#logs-note")  # pending: no node has run it
    ui.shot("job")
    ui.page.click("#nav-nodes")
    ui.visible("#nodes-empty")  # no agents here
    ui.shot("nodes")
    ui.page.goto(f"{live_server}/ui/#/jobs/no-such-job-1")
    assert "No job no-such-job-1" in ui.visible("#job-missing").inner_text()
    ui.page.wait_for_timeout(500)
    # a 404 of the API shows up as a failed resource load only for the missing job
    assert [e for e in ui.console_errors if "404" not in e] == [], ui.console_errors
    assert len(ui.console_errors) <= 1


@pytest.mark.timeout(60)
def test_trace_link_downloads_the_job_trace_with_the_token(ui: UiPage, live_server: str) -> None:
    job = _submit(live_server)
    ui.sign_in(live_server, READER, route=f"#/jobs/{job['id']}")
    link = ui.visible("#trace-link")
    assert link.get_attribute("href") == f"/v1/jobs/{job['id']}/trace"
    with ui.page.expect_download() as download:
        link.click()
    path = download.value.path()
    trace = json.loads(path.read_text())
    assert trace["traceEvents"] and download.value.suggested_filename == f"{job['id']}.trace.json"
    assert ui.console_errors == []


@pytest.mark.timeout(60)
def test_controller_without_tokens_needs_no_sign_in(ui: UiPage, etcd_server: LocalEtcdCluster, key_prefix: str) -> None:
    with serve(make_settings(etcd_server, key_prefix, tokens=None)) as url:
        job = httpx.post(f"{url}/v1/jobs", json=SPEC).json()
        ui.page.goto(f"{url}/ui/")
        ui.visible(f"tr[data-job-id='{job['id']}']")
        assert "authentication is off" in ui.page.inner_text("#auth-state")
        assert not ui.page.is_visible("#login") and ui.console_errors == []


@pytest.mark.timeout(60)
def test_text_from_the_api_is_shown_as_text_never_run_as_html(ui: UiPage, live_server: str) -> None:
    entrypoint = '<img src=x onerror="window.__xss=1">train.py'
    job = _submit(live_server, {**SPEC, "entrypoint": entrypoint})
    ui.sign_in(live_server, READER, route=f"#/jobs/{job['id']}")
    assert entrypoint in ui.visible("#job-summary dl").inner_text()
    assert ui.page.locator("#job-summary img").count() == 0
    assert ui.page.evaluate("() => window.__xss") is None and ui.console_errors == []
