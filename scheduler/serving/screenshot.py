"""The live dashboard in a headless browser: open it, watch it, screenshot it.

:func:`dashboard_screenshot` is what the demo's report calls; :func:`open_dashboard` is the same
browser session for a caller that wants to look inside the page first (the browser test).

The browser is the system's Chromium (Debian's ``chromium`` package, ``SMARTEXIT_CHROMIUM`` to point
elsewhere), driven by playwright; never ``playwright install`` (a download). The flags keep a root,
offline, headless Chromium from needing a sandbox, a GPU or Google's servers. Playwright's sync API
drives one browser per thread at a time and refuses a thread with a running asyncio loop: call these
from plain synchronous code, one at a time.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from edge.core.errors import MissingExtraError, SmartExitError

CHROMIUM_ENV = "SMARTEXIT_CHROMIUM"
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")
VIEWPORT = {"width": 1280, "height": 1500}  # every panel of the two-column grid in one screenshot


class BrowserUnavailable(SmartExitError):
    """No Chromium to drive (the message says where it looked and how to install one)."""


def find_chromium() -> Path:
    """The Chromium binary: ``$SMARTEXIT_CHROMIUM``, else Debian's, else ``chromium`` on PATH.

    Raises:
        BrowserUnavailable: none found.
    """
    env = os.environ.get(CHROMIUM_ENV)
    if env:
        if not Path(env).is_file():
            raise BrowserUnavailable(f"{CHROMIUM_ENV}={env} is not a file")
        return Path(env)
    for path in CHROMIUM_PATHS:
        if Path(path).is_file():
            return Path(path)
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return Path(found)
    raise BrowserUnavailable(f"no Chromium found ({', '.join(CHROMIUM_PATHS)}, PATH, ${CHROMIUM_ENV}): "
                             "apt-get install chromium (not `playwright install`, which downloads one)")


def dashboard_url(base_url: str, api_key: str | None = None) -> str:
    """The page's URL on the server at ``base_url`` (``http://host:port``), with ``?key=`` when a key
    is configured (the page trades it for a cookie and redirects to plain ``/dashboard``)."""
    url = base_url.rstrip("/") + "/dashboard"
    return url if api_key is None else f"{url}?key={quote(api_key, safe='')}"


@dataclass
class DashboardSession:
    """An open dashboard page and what the browser saw so far."""
    page: Any  # playwright.sync_api.Page
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)  # network failures and HTTP answers >= 400

    def state(self) -> dict[str, Any]:
        """The page's own view (``window.smartexitDashboard``): polls, rows held, points per chart,
        the newest tokens/s and TTFT p50, and the errors its polling met."""
        return self.page.evaluate("""() => {
            const d = window.smartexitDashboard;
            const charts = Object.fromEntries(Object.entries(d.charts).map(
                ([id, c]) => [id, c.chart.data[0].length]));
            return {polls: d.polls, rows: d.points(), charts, errors: d.errors,
                    t: d.value("t"), tokens_per_s: d.value("tokens_per_s"), ttft_p50_ms: d.value("ttft_p50_ms"),
                    exit_tokens: d.data ? d.data.exit_layers.total.reduce((a, b) => a + b, 0) : 0};
        }""")

    def wait_for_rows(self, rows: int, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until the page holds ``rows`` rows; its :meth:`state`.

        Raises:
            SmartExitError: not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st["rows"] >= rows:
                return st
            if time.monotonic() > deadline:
                raise SmartExitError(f"the dashboard held {st['rows']} rows after {timeout_s:.0f} s, not {rows} "
                                     f"(console errors: {self.console_errors}, failed: {self.failed_requests})")
            self.page.wait_for_timeout(250)


@contextlib.contextmanager
def open_dashboard(base_url: str, api_key: str | None = None, viewport: dict[str, int] | None = None
                   ) -> Iterator[DashboardSession]:
    """Open ``base_url``'s dashboard in headless Chromium; yields the session (closed on exit).

    Raises:
        MissingExtraError: playwright is not installed.
        BrowserUnavailable: no Chromium.
        SmartExitError: the page did not load (its HTTP status in the message).
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise MissingExtraError(f"playwright is not installed ({exc}): pip install playwright (pinned in "
                                "requirements/lock.txt); the browser is the system's chromium") from exc
    chromium = find_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=list(CHROMIUM_ARGS), headless=True)
        try:
            page = browser.new_page(viewport=viewport or VIEWPORT)
            session = DashboardSession(page)
            page.on("console", lambda m: session.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: session.console_errors.append(f"uncaught: {exc}"))
            page.on("requestfailed", lambda r: session.failed_requests.append(f"{r.url}: {r.failure}"))
            page.on("response", lambda r: session.failed_requests.append(f"{r.url}: HTTP {r.status}")
                    if r.status >= 400 else None)
            resp = page.goto(dashboard_url(base_url, api_key), wait_until="load")
            if resp is None or not resp.ok:
                raise SmartExitError(f"{base_url}/dashboard answered {None if resp is None else resp.status}")
            yield session
        finally:
            browser.close()


def dashboard_screenshot(url: str, out_png: str | Path, seconds: float = 5.0, api_key: str | None = None) -> Path:
    """A PNG of the live dashboard of the server at ``url`` (its base URL, ``http://host:port``) after
    watching it for ``seconds`` (the charts fill at one point a second); returns ``out_png``.

    Raises:
        MissingExtraError: playwright is not installed.
        BrowserUnavailable: no Chromium.
        SmartExitError: the page did not load or never received data.
    """
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open_dashboard(url, api_key) as session:
        session.wait_for_rows(1)
        session.page.wait_for_timeout(1000 * seconds)
        session.page.screenshot(path=str(out), full_page=True)
    return out
