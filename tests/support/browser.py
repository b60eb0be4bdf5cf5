"""Debian's headless Chromium through Playwright, for the page tests and the screenshots script.

Never `playwright install`: these machines are offline, and Debian's browser is the one CI has.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
