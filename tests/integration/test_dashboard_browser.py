"""The live dashboard on the real stack (Ray Serve + tritonserver, ``serving_stack``), with an API key
configured, under load, in a real headless Chromium (Debian's, driven by playwright).

One stack for the module: the key rules over plain HTTP (401 without it, the ``?key=`` cookie
exchange, the public assets), then the browser: no console error, no failed request, every chart
filling and the data moving between two looks, a screenshot (under pytest's tmp dir and, when
``SMARTEXIT_SCREENSHOT_DIR`` is set, there too).
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.integration.test_serving import MODEL, PROMPT, _start

pytestmark = pytest.mark.integration

KEY = "dashboard-test-key"
TIME_CHARTS = {"chart-ttft", "chart-tpot", "chart-sla", "chart-tps", "chart-sched", "chart-queue", "chart-power",
               "chart-energy", "chart-audit"}


@pytest.fixture(scope="module")
def stack(served_run, repository_copy, find_processes, tmp_path_factory, free_port):
    yield from _start(served_run, repository_copy, find_processes, tmp_path_factory, free_port(), "dashboard",
                      api_key=KEY, dashboard_tick_s=0.5)


@pytest.fixture(scope="module")
def browser_ready():
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements/lock.txt)")
    from scheduler.serving.screenshot import BrowserUnavailable, find_chromium

    try:
        return find_chromium()
    except BrowserUnavailable as exc:
        pytest.skip(f"no Chromium for the browser test: {exc}")


def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def complete(url: str, max_tokens: int) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": PROMPT,
                                                                 "max_tokens": max_tokens, "temperature": 0}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


class Load:
    """Completions from 4 threads until stopped (at least ``minimum`` of them); their statuses."""

    def __init__(self, url: str, minimum: int = 24) -> None:
        self.url, self.minimum, self.statuses = url, minimum, []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(4)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set() or len(self.statuses) < self.minimum:
            self.statuses.append(complete(self.url, 16 + 8 * ((i + n) % 4)))
            n += 1

    def __enter__(self) -> "Load":
        self._futures = [self._pool.submit(self._run, i) for i in range(4)]
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        self._pool.shutdown()


def test_the_key_guards_the_page_and_its_data_not_its_public_assets(stack):
    """With ``serve.api_key``: /dashboard and /dashboard/data answer 401 without the key (and with a
    wrong one); the Bearer header opens both; ``?key=K`` answers 303 to /dashboard with an HttpOnly,
    SameSite=Strict cookie that is not the key and opens both; the script, style and uPlot are
    served without a key (public code), and no other path under /dashboard/static is."""
    for path in ("/dashboard", "/dashboard/data", "/dashboard?key=wrong"):
        status, headers, body = get(stack.url, path)
        assert status == 401, path
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert "/dashboard?key=" in json.loads(body)["error"]["message"] or "?key=" in path
    bearer = {"Authorization": f"Bearer {KEY}"}
    status, headers, body = get(stack.url, "/dashboard", bearer)
    assert status == 200 and headers["content-type"].startswith("text/html") and b"uPlot" in body
    assert "default-src 'self'" in headers["content-security-policy"]
    assert headers["referrer-policy"] == "no-referrer"
    status, _, body = get(stack.url, "/dashboard/data", bearer)
    assert status == 200 and json.loads(body)["sla"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}

    status, headers, _ = get(stack.url, f"/dashboard?key={KEY}")
    assert status == 303 and headers["location"] == "dashboard"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
    assert KEY not in cookie
    jar = {"Cookie": cookie.split(";")[0]}
    assert get(stack.url, "/dashboard", jar)[0] == 200
    assert get(stack.url, "/dashboard/data?since=0", jar)[0] == 200
    assert get(stack.url, "/v1/models", jar)[0] == 401  # the cookie opens the dashboard only
    assert get(stack.url, "/dashboard/data?since=yesterday", jar)[0] == 400

    for asset in ("dashboard.js", "dashboard.css", "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css"):
        assert get(stack.url, f"/dashboard/static/{asset}")[0] == 200, asset
    for path in ("/dashboard/static/dashboard.html", "/dashboard/static/../config.py",
                 "/dashboard/static/vendor/uplot/README.md"):
        assert get(stack.url, path)[0] == 404, path
    status, _, body = get(stack.url, "/metrics", bearer)
    assert status == 200 and b"smartexit_sla_ttft_target_seconds 1.0" in body


def test_the_page_fills_and_moves_under_load_in_chromium(stack, browser_ready, tmp_path):
    """Under a few dozen completions: the page (opened with ?key=) logs no console error and no
    request of it fails; every chart holds points; between two looks a few seconds apart the page
    has polled again, holds more rows, a newer timestamp and more tokens in its exit-layer
    histogram; latency and tokens/s have values; the power panels say why there is no chart (no
    meter configured); the scheduler table names the policy. Then a screenshot."""
    from scheduler.serving.screenshot import dashboard_screenshot, open_dashboard

    with Load(stack.url) as load:
        with open_dashboard(stack.url, api_key=KEY) as session:
            first = session.wait_for_rows(3, timeout_s=30)
            session.page.wait_for_timeout(3000)
            second = session.state()
            assert session.page.url.endswith("/dashboard")  # the key left the address bar
            reason = session.page.inner_text("#power-reason")
            policies = session.page.inner_text("#policies")
            false_exits = session.page.inner_text("#false-exits")
        # playwright's sync API runs one browser per thread at a time: the screenshot's own comes after
        png = dashboard_screenshot(stack.url, tmp_path / "dashboard.png", seconds=2, api_key=KEY)
    assert session.console_errors == [] and session.failed_requests == []
    assert first["errors"] == [] and second["errors"] == []
    assert set(second["charts"]) == TIME_CHARTS
    assert all(n >= 3 for n in second["charts"].values()), second["charts"]
    assert second["polls"] > first["polls"] and second["rows"] > first["rows"] and second["t"] > first["t"]
    assert second["exit_tokens"] > first["exit_tokens"] > 0
    assert second["tokens_per_s"] > 0 and second["ttft_p50_ms"] > 0
    assert "serve.power_meter is 'none'" in reason
    assert "aimd" in policies
    assert re.fullmatch(r"\d+\.\d\d% \(≤ \d+\.\d\d%\) of \d+ tokens; ε \d+\.\d\d%", false_exits), false_exits
    assert len(load.statuses) >= load.minimum and set(load.statuses) == {200}

    assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out_dir = os.environ.get("SMARTEXIT_SCREENSHOT_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(out_dir) / "dashboard.png")
