"""Fixtures of the dashboard's browser tests: Chromium driven by Playwright, controllers that demand tokens.

The browser is Debian's ``/usr/bin/chromium`` (``scripts/setup.sh`` installs it), never one that Playwright
downloads; without Playwright (the torch compatibility runs install only ``[test]``) or without that binary the
browser tests are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from elastic.testing.etcd_server import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

    from service.core.config import Settings
    from service.testing.cluster import LocalServiceCluster

CHROMIUM = Path("/usr/bin/chromium")


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e .[dev])"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium; scripts/setup.sh does)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    reason = browser_missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield b
        finally:
            b.close()


@dataclass
class UiPage:
    """A page in a fresh browser context that records what went wrong in it."""

    page: Page
    shots: Path
    console_errors: list[str] = field(default_factory=list)

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def visible(self, selector: str, timeout: float | None = None) -> Locator:
        """The first element ``selector`` matches, once it is visible."""
        found = self.page.locator(selector).first
        found.wait_for(state="visible", timeout=timeout)
        return found

    def sign_in(self, base_url: str, token: str, route: str = "#/jobs") -> None:
        self.page.goto(f"{base_url}/ui/{route}")
        self.page.fill("#token-input", token)
        self.page.click("#token-submit")
        self.page.wait_for_selector("#login", state="hidden")


@pytest.fixture
def ui(browser: Browser, tmp_path: Path) -> Iterator[UiPage]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(15_000)
    out = UiPage(page, tmp_path / "screenshots")
    out.shots.mkdir()
    page.on("console", lambda msg: out.console_errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: out.console_errors.append(f"uncaught: {exc}"))
    try:
        yield out
    finally:
        context.close()


@contextmanager
def serve(settings: Settings) -> Iterator[str]:
    """The controller app (reconcile loop included) served by uvicorn on a loopback port; its URL."""
    import uvicorn

    from service.api.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def start_controller_with_tokens(cluster: LocalServiceCluster, tokens: dict[str, str]) -> Any:
    """``cluster.start_controller`` with ``--tokens-file`` (token -> role); an ApiClient holding the admin token."""
    return cluster.start_controller(tokens=tokens)
