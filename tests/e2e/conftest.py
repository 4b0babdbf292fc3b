"""Browser end-to-end fixtures: Debian's Chromium driven by Playwright, a real uvicorn server
on a free loopback port, and a console page that fails the test on any script error or
Content-Security-Policy violation.

Chromium is /usr/bin/chromium (Debian's ``chromium`` package) or TIERGATE_CHROMIUM; when it is
missing the tests fail with the install command, they never skip. Playwright never downloads
a browser here. Screenshots go to TIERGATE_ARTIFACTS_DIR (default artifacts/console/, ignored
by git) for CI to keep as artifacts.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Browser, ConsoleMessage, Error, Page, expect, sync_playwright
from starlette.types import ASGIApp

CHROMIUM_ENV = "TIERGATE_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
ARTIFACTS_ENV = "TIERGATE_ARTIFACTS_DIR"
DEFAULT_ARTIFACTS_DIR = Path(__file__).resolve().parents[2] / "artifacts" / "console"
ADMIN_TOKEN = "console-e2e-admin-token-0123456789"
# Generous for 2 shared CPU cores; a passing run waits far less.
EXPECT_TIMEOUT_MS = 15_000
SERVER_START_TIMEOUT_S = 20.0


# Package scope, not session: Playwright's sync API keeps an event loop running on the main
# thread while it is open, and every later test that calls asyncio.run() would fail.
@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    executable = os.environ.get(CHROMIUM_ENV, DEFAULT_CHROMIUM)
    if not Path(executable).is_file():
        pytest.fail(
            f"Chromium not found at {executable}: install Debian's browser with "
            "`apt-get install -y --no-install-recommends chromium` "
            f"(or point {CHROMIUM_ENV} at one). The console tests never skip.",
            pytrace=False,
        )
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    directory = Path(os.environ.get(ARTIFACTS_ENV, DEFAULT_ARTIFACTS_DIR))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextmanager
def serve_in_thread(app: ASGIApp) -> Iterator[str]:
    """Serve app with uvicorn in a thread on a free loopback port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", ws="none", http="h11", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclass
class ConsolePage:
    """A browser tab on the console that records script errors and CSP violations."""

    page: Page
    base_url: str
    artifacts_dir: Path
    # Uncaught exceptions and console errors other than failed HTTP responses.
    problems: list[str] = field(default_factory=list)

    def open(self, fragment: str = "") -> None:
        response = self.page.goto(f"{self.base_url}/admin{fragment}")
        # None: only the fragment changed, the page stayed.
        if response is not None and response.status != 200:
            raise AssertionError(
                f"GET /admin answered {response.status}: does the app include console_routes()?"
            )

    def sign_in(self, token: str = ADMIN_TOKEN) -> None:
        self.page.get_by_label("Admin token").fill(token)
        self.page.get_by_role("button", name="Sign in").click()

    def go(self, view: str) -> None:
        """Follow a nav link, as a user would."""
        self.page.get_by_role("navigation", name="Views").get_by_role("link", name=view).click()

    def screenshot(self, name: str) -> None:
        self.page.screenshot(path=self.artifacts_dir / f"{name}.png", full_page=True)

    def _on_console(self, message: ConsoleMessage) -> None:
        # Chromium logs every 4xx answer to fetch() as "Failed to load resource": the console
        # asks for them on purpose (wrong token, missing endpoints) and shows them inline.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.problems.append(f"console: {message.text}")

    def _on_page_error(self, error: Error) -> None:
        self.problems.append(f"uncaught: {error.message}")


@contextmanager
def console_page(browser: Browser, base_url: str, artifacts_dir: Path) -> Iterator[ConsolePage]:
    """A fresh browser context (empty sessionStorage) on base_url; fails on script problems."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
    page = context.new_page()
    console = ConsolePage(page, base_url, artifacts_dir)
    page.on("console", console._on_console)
    page.on("pageerror", console._on_page_error)
    try:
        yield console
    finally:
        context.close()
    assert console.problems == [], console.problems
