"""Page render time in a real browser when the engine wrote megabyte-long text.

Seeds SQLite with the page tests' sample, then records one more run through the product's own
write path (tests/support/long_text.py: the Recorder and the watch's flusher) whose label, config,
input name, wrapper, violation message and stack and torch.compile reason are each 1 MB (unbroken
text, and a traceback of many lines for the stack). Starts `graph-inspector serve` and loads every
page that shows that run in Debian's headless Chromium, timing from navigation to the first frame
painted after the load event; the median of repeated loads per page. Target: every page under 2 s.

    python3 bench/long_text_pages.py --out bench/results/long_text_pages.json
    python3 bench/long_text_pages.py --quick      # 100 kB fields, 2 loads: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from bench.common import command_line, print_table, print_targets, target, write_results
from inspector.storage.store import open_store
from tests.support.browser import chromium, render_seconds
from tests.support.daemon import Daemon
from tests.support.long_text import MB, LongTextRun, plant_long_text
from tests.support.sample import seed_sample

TARGET_S = 2.0


def long_text_pages(run: LongTextRun, other_run: int) -> dict[str, str]:
    """Every page that shows the long-text run's fields: page name -> path."""
    return {
        "overview": f"?run={run.run_id}",
        "graphs": f"graphs?run={run.run_id}",
        "graph": f"graphs/{run.graph_id}",
        "violations": f"violations?run={run.run_id}",
        "compile": f"compile?run={run.run_id}",
        "runs": "runs",
        "compare": f"runs/compare?a={run.run_id}&b={other_run}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/long_text_pages.json"))
    parser.add_argument("--size", type=int, default=MB, help="characters per long field (default 1,000,000)")
    parser.add_argument("--repeats", type=int, default=5, help="loads per page (default 5)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="give up on one load after this long "
                        "(it counts as this long, and as timed out; default 120)")
    parser.add_argument("--quick", action="store_true", help="100 kB fields, 2 loads per page: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.size, args.repeats = 100_000, 2

    scratch = tempfile.TemporaryDirectory()
    url = f"sqlite:///{Path(scratch.name) / 'long-text.db'}"
    store = open_store(url, upgrade=True)
    sample = seed_sample(store, now=time.time())
    store.dispose()
    started = time.perf_counter()
    run = plant_long_text(url, args.size)
    print(f"recorded a run with {args.size:,}-character fields in {time.perf_counter() - started:.1f} s",
          flush=True)

    results, rows, targets = {}, [], []
    with Daemon(url) as daemon, chromium() as browser:
        for name, path in long_text_pages(run, sample["cuda_run"]).items():
            samples, timed_out = [], 0
            for _ in range(args.repeats):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                try:
                    samples.append(render_seconds(page, daemon.url + path, args.timeout_s))
                except PlaywrightTimeout:  # a load past the timeout is a result: at least that long
                    samples.append(args.timeout_s)
                    timed_out += 1
                finally:
                    page.close()
            median = statistics.median(samples)
            shown = f"> {args.timeout_s:g}" if timed_out > len(samples) // 2 else median
            results[name] = {"path": "/" + path, "median_s": median, "max_s": max(samples), "loads": samples,
                             "timed_out": timed_out}
            rows.append((name, "/" + path, shown, min(samples), max(samples), timed_out))
            targets.append(target(f"{name} page, median render", median, TARGET_S, unit=" s",
                                  applies=not args.quick))
            print(f"  {name}: median {median:.2f} s over {len(samples)} loads, {timed_out} timed out",
                  flush=True)
    scratch.cleanup()

    print_table(f"Render time with {args.size:,}-character fields (s, headless Chromium)",
                ("page", "path", "median", "min", "max", "timed out"), rows)
    print_targets(targets)
    write_results(
        args.out,
        benchmark="long_text_pages",
        command=command_line(),
        device=torch.device("cpu"),
        config={"field_chars": args.size, "repeats": args.repeats, "quick": args.quick, "database": "sqlite",
                "browser": "Debian chromium, headless, via Playwright",
                "measured": "navigation to the first frame painted after the load event"},
        results=results,
        targets=targets,
        notes=["figures from --quick are a smoke run, not results"] if args.quick else [],
    )
    print(f"\nwrote {args.out}")
    return 0 if all(t["met"] is not False for t in targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
