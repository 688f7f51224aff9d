"""``/docs`` in a real browser (Chromium through Playwright) against a real controller: Swagger UI renders the API's
operations under the page's strict Content-Security-Policy (a violation is a console error) and the page asks no other
origin for anything, also in a tab that holds the dashboard's token."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.service.conftest import READER
from tests.service.ui.conftest import UiPage

pytestmark = pytest.mark.xdist_group("docs_browser")  # one worker, one browser (a module fixture)


@pytest.mark.timeout(90)
def test_swagger_ui_renders_from_the_controllers_origin_alone_without_csp_violations(
    ui: UiPage, live_server: str
) -> None:
    requested: list[str] = []
    ui.page.on("request", lambda request: requested.append(request.url))
    ui.sign_in(live_server, READER)  # the dashboard keeps the token in this tab's sessionStorage
    ui.page.goto(f"{live_server}/docs")
    ui.visible(".opblock")
    assert "/v1/jobs" in ui.page.locator(".opblock-summary-path").all_inner_texts()
    ui.page.locator(".opblock-summary").first.click()  # an operation's details: schemas, examples, icons
    ui.visible(".opblock-body")
    ui.shot("docs")
    ours = urlsplit(live_server).netloc
    others = [u for u in requested if not u.startswith("data:") and urlsplit(u).netloc != ours]
    assert others == []
    assert ui.console_errors == []  # a blocked script, style or image would be one
