"""Debian's headless Chromium through Playwright, for the page tests, the screenshots script and
the long-text benchmark.

Never `playwright install`: these machines are offline, and Debian's browser is the one CI has.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]

CHARTS_DRAWN = """() => Object.fromEntries([...document.querySelectorAll("canvas")].map((canvas) => {
    const chart = window.Chart && window.Chart.getChart(canvas);
    const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let painted = false;
    for (let i = 3; i < pixels.length; i += 4) { if (pixels[i] !== 0) { painted = true; break; } }
    return [canvas.id, Boolean(chart) && painted];
}))"""
"""Per canvas of the page: a Chart.js chart is attached and has painted non-transparent pixels."""


@contextmanager
def chromium() -> Iterator[object]:
    """A launched headless Chromium (a Playwright ``Browser``), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


AFTER_TWO_FRAMES = "() => requestAnimationFrame(() => requestAnimationFrame(() => { window.__painted = 1; }))"
"""Marks the page once the browser has laid out and painted a frame: until then a page whose layout
is stuck shows a blank tab."""


def render_seconds(page: Any, url: str, timeout_s: float = 120.0) -> float:
    """Seconds from navigating ``page`` to ``url`` until its first frame after the load event is
    painted (the page answered 200, its scripts ran). Raises Playwright's TimeoutError past
    ``timeout_s`` in all."""
    started = time.perf_counter()
    response = page.goto(url, wait_until="load", timeout=timeout_s * 1000)
    if response is None or response.status != 200:
        raise AssertionError(f"{url}: {response and response.status}")
    page.evaluate(AFTER_TWO_FRAMES)
    left_ms = max(1.0, (timeout_s - (time.perf_counter() - started)) * 1000)
    page.wait_for_function("() => window.__painted === 1", timeout=left_ms)
    return time.perf_counter() - started
