"""Dashboard latency on a large database: p95 of the overview page, each API call and /metrics.

Seeds SQLite with 1,000 graphs, 1,000,000 replay windows and 100,000 violations (bulk inserts,
about a minute on two cores), starts the real daemon (`graph-inspector serve`, waitress, a child
process) on a free loopback port, and times sequential requests over one keep-alive connection,
as a browser tab or a Prometheus scrape would send them. Targets (issue 4): p95 < 200 ms for the
overview and every API call, < 100 ms for /metrics. The daemon loads its time series before it
prints its URL; that start-up time is reported too.

    python3 bench/dashboard_bench.py --out bench/results/dashboard.json
    python3 bench/dashboard_bench.py --quick      # small database, a smoke run in seconds
"""

from __future__ import annotations

import argparse
import http.client
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import command_line, print_table, print_targets, target, write_results
from inspector.storage.store import open_store
from tests.support.daemon import Daemon
from tests.support.sample import seed_bulk

PAGE_TARGET_MS = 200.0
METRICS_TARGET_MS = 100.0


def endpoints(graph_id: int, violation_id: int) -> dict[str, tuple[str, float]]:
    """name -> (path, p95 target in ms)."""
    return {
        "overview page": ("/", PAGE_TARGET_MS),
        "/api/summary": ("/api/summary", PAGE_TARGET_MS),
        "/api/summary?run=": ("/api/summary?run=3", PAGE_TARGET_MS),
        "/api/graphs": ("/api/graphs", PAGE_TARGET_MS),
        "/api/graphs sorted, filtered": ("/api/graphs?mode=full&sort=pool_bytes&order=desc", PAGE_TARGET_MS),
        "/api/graphs/<id>": (f"/api/graphs/{graph_id}", PAGE_TARGET_MS),
        "/api/violations": ("/api/violations", PAGE_TARGET_MS),
        "/api/violations?kind=&run=": ("/api/violations?kind=address_drift&run=2", PAGE_TARGET_MS),
        "/api/violations deep page": ("/api/violations?page=1000&per_page=50", PAGE_TARGET_MS),
        "/api/violations/<id>": (f"/api/violations/{violation_id}", PAGE_TARGET_MS),
        "/api/runs": ("/api/runs", PAGE_TARGET_MS),
        "/api/runs/compare": ("/api/runs/compare?a=1&b=2", PAGE_TARGET_MS),
        "graphs page": ("/graphs", PAGE_TARGET_MS),
        "violations page": ("/violations", PAGE_TARGET_MS),
        "/metrics": ("/metrics", METRICS_TARGET_MS),
    }


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


def time_requests(base_url: str, path: str, repeats: int, warmup: int) -> tuple[list[float], int]:
    """Milliseconds per request (response fully read), over one keep-alive connection."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    samples, size = [], 0
    try:
        for i in range(warmup + repeats):
            started = time.perf_counter()
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            elapsed = (time.perf_counter() - started) * 1000
            if response.status != 200:
                raise SystemExit(f"{path} answered {response.status}: {body[:300]!r}")
            if i >= warmup:
                samples.append(elapsed)
                size = len(body)
    finally:
        conn.close()
    return samples, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/dashboard.json"))
    parser.add_argument("--db", type=Path, help="SQLite file to use; seeded first when it does not exist "
                        "(default: a fresh temporary file)")
    parser.add_argument("--graphs", type=int, default=1_000)
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--violations", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=60, help="timed requests per endpoint (default 60)")
    parser.add_argument("--quick", action="store_true", help="a small database and few requests: a smoke "
                        "run whose figures are not results")
    args = parser.parse_args()
    if args.quick:
        args.graphs, args.windows, args.violations, args.repeats = 100, 20_000, 2_000, 10

    scratch = tempfile.TemporaryDirectory()
    db_path = args.db or Path(scratch.name) / "bench.db"
    url = f"sqlite:///{db_path.resolve()}"
    seed_seconds = None
    if not db_path.exists():
        store = open_store(url, upgrade=True)
        started = time.perf_counter()
        seed_bulk(store, now=time.time(), graphs=args.graphs, windows=args.windows,
                  violations=args.violations)
        seed_seconds = time.perf_counter() - started
        store.dispose()
        print(f"seeded {args.graphs:,} graphs, {args.windows:,} replay windows, {args.violations:,} "
              f"violations in {seed_seconds:.1f} s", flush=True)

    started = time.perf_counter()
    with Daemon(url, start_timeout=600) as daemon:
        startup_seconds = time.perf_counter() - started
        rows, results, targets = [], {}, []
        paths = endpoints(graph_id=args.graphs // 2, violation_id=args.violations // 2)
        for name, (path, limit) in paths.items():
            samples, size = time_requests(daemon.url, path, args.repeats, warmup=3)
            ordered = sorted(samples)
            result = {"path": path, "p50_ms": ordered[len(ordered) // 2], "p95_ms": p95(samples),
                      "max_ms": ordered[-1], "requests": len(samples), "bytes": size}
            results[name] = result
            targets.append(target(f"p95 {name}", result["p95_ms"], limit, unit=" ms", applies=not args.quick))
            rows.append((name, result["p50_ms"], result["p95_ms"], result["max_ms"], size))
    scratch.cleanup()

    print_table("Dashboard latency (ms, sequential requests on one connection)",
                ("endpoint", "p50", "p95", "max", "bytes"), rows)
    print(f"\ndaemon start-up (imports, migrations check, time-series load): {startup_seconds:.1f} s")
    print_targets(targets)
    notes = ["figures from --quick are a smoke run, not results"] if args.quick else []
    write_results(
        args.out,
        benchmark="dashboard",
        command=command_line(),
        device=torch.device("cpu"),
        config={"graphs": args.graphs, "replay_windows": args.windows, "violations": args.violations,
                "repeats": args.repeats, "database": "sqlite", "server": "waitress (graph-inspector serve)"},
        results={"endpoints": results, "seed_seconds": seed_seconds,
                 "daemon_startup_seconds": startup_seconds},
        targets=targets,
        notes=notes,
    )
    print(f"\nwrote {args.out}")
    return 0 if all(t["met"] is not False for t in targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
