#!/usr/bin/env python3
"""Regenerate docs/screenshot-overview.png, docs/screenshot-violations.png and docs/screenshot-advice.png.

Photographs a recorded database (`--db URL`), or, without `--db`, a fresh SQLite file seeded with
the dashboard's sample (two runs, one live on the eager backend, injected faults). Starts
`graph-inspector serve` on a free loopback port (the checkout's, or with GRAPH_INSPECTOR_INSTALL=DIR
the wheel installed there by `python3 -m tests.support.installed DIR`) and photographs the pages in
Debian's headless Chromium. The committed ones show the installed wheel's own demo:

    python3 -m tests.support.installed /tmp/gi && cd /tmp/gi
    venv/bin/graph-inspector demo --no-serve --db sqlite:////tmp/gi/demo.db; cd -
    GRAPH_INSPECTOR_INSTALL=/tmp/gi python3 scripts/screenshots.py --db sqlite:////tmp/gi/demo.db
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from inspector.storage.store import open_store  # noqa: E402
from tests.support.browser import chromium  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402
from tests.support.sample import seed_sample  # noqa: E402

PAGES = {"screenshot-overview.png": "", "screenshot-violations.png": "violations",
         "screenshot-advice.png": "advice"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for the PNGs (default docs/)")
    parser.add_argument("--db", help="photograph this database instead of a seeded sample")
    parser.add_argument("--page", action="append", default=[], metavar="FILE=PATH",
                        help="photograph PATH of the dashboard into FILE instead of the three above "
                        "(repeat; e.g. screenshot-vllm-graphs.png=graphs?run=1)")
    args = parser.parse_args()
    pages = dict(PAGES)
    if args.page:
        try:
            pages = dict(item.split("=", 1) for item in args.page)
        except ValueError:
            parser.error("--page takes FILE=PATH, e.g. screenshot-graphs.png=graphs")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        url = args.db
        if url is None:
            url = f"sqlite:///{Path(scratch) / 'sample.db'}"
            store = open_store(url, upgrade=True)
            seed_sample(store, now=time.time())
            store.dispose()
        with Daemon(url) as daemon, chromium() as browser:
            page = browser.new_page(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
            for name, path in pages.items():
                page.goto(daemon.url + path, wait_until="networkidle")
                page.screenshot(path=str(args.out / name), full_page=True)
                print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
