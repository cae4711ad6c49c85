"""Helpers for the dashboard's browser tests: Debian's Chromium driven by Playwright, and the
dashboard served on 127.0.0.1 for the length of a `with` block.

A missing browser fails the test with the command that installs it (`.ci/run` runs it): a
browser test that skipped would pass CI without looking at the page.
"""

import contextlib
import os
import shutil
import socket
import sys
import threading
import time

import pytest

CHROMIUM = "/usr/bin/chromium"


def chromium_path() -> str:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: the dashboard's browser tests need it. Install it with "
                    "`apt-get update && apt-get install -y chromium` (as root; .ci/run does this)")
    return CHROMIUM


@contextlib.contextmanager
def browser_page():
    """A fresh Chromium page; every request it makes is recorded in `page.requested`."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            page.requested, page.errors = [], []
            page.on("request", lambda request: page.requested.append(request.url))
            page.on("pageerror", lambda error: page.errors.append(str(error)))
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def serving(experiment: str, graph):
    """The live dashboard of `graph` on a free port of 127.0.0.1; yields its URL."""
    from keel.dashboard import make_server

    server = make_server(experiment, graph, port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def node_states(page) -> dict[str, str]:
    """{step name: state} as the page's graph draws them."""
    return page.eval_on_selector_all("g.node", "nodes => Object.fromEntries(nodes.map(n => [n.dataset.step, n.dataset.state]))")


def points(page, run: str, chart: str, series: str) -> int:
    """How many points the page drew for `series` in `run`'s `chart`."""
    line = page.locator(f'.run[data-run="{run}"] svg[data-chart="{chart}"] polyline[data-series="{series}"]')
    return int(line.get_attribute("data-points"))


def local_only(requests: list[str]) -> list[str]:
    """The requests that left the machine (should be none)."""
    return [u for u in requests if not (u.startswith("file://") or u.startswith("http://127.0.0.1:"))]


def keel_command() -> list[str]:
    """`uv run --locked keel` (the README's spelling), or this interpreter's keel without uv."""
    uv = shutil.which("uv")
    return [uv, "run", "--locked", "keel"] if uv else [sys.executable, "-m", "keel.cli_entry"]


def wait_until_listening(port: int, timeout: float) -> None:
    """Return once 127.0.0.1:`port` accepts a connection; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f}s")
