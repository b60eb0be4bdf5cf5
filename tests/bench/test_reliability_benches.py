"""bench/reliability.py and bench/fleet_bench.py run as documented (their quick forms), and their
figures hang together: every event accounted for, every page timed, the retention folding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(*argv: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, *argv, "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads(out.read_text())
    assert payload["config"]["quick"] is True and "Targets" in done.stdout
    return payload


def test_the_reliability_benchmark_accounts_for_every_event(tmp_path: Path) -> None:
    payload = _run("bench/reliability.py", out=tmp_path / "reliability.json")
    results = payload["results"]
    assert len(results) == 8
    for name, result in results.items():
        if "skipped" in result:
            assert os.geteuid() != 0, f"{name} was skipped as root: {result['skipped']}"
            continue
        assert result.get("survived", True), f"{name}: {result.get('stderr_tail')}"
        if "events" in result:
            assert result["events"]["unaccounted"] == 0, (name, result["events"])
            assert result["events"]["reported"] > 0
    locked = results["database locked past close_timeout"]["events"]
    assert locked["dropped"] >= 42_600, "the lost window is counted as its replays"
    assert results["corrupt file at start"]["file_untouched"] is True
    assert all(t["met"] is not False for t in payload["targets"])


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_fleet_benchmark_times_every_page_over_a_folded_fleet(tmp_path: Path, database: str) -> None:
    if database == "postgres" and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("PostgreSQL server binaries not found; CI installs them")
    payload = _run("bench/fleet_bench.py", "week", "--db", database, out=tmp_path / "fleet.json")
    built = payload["results"]["database"]
    assert built["rows_folded"] > 0 and built["rows"]["runs"] == 4
    # 3 hours: the last at 1 s (4 graphs a second), the first two by the minute.
    assert built["rows"]["replay_windows"] == 4 * 4 * (3600 + 2 * 60)
    assert built["rows"]["step_sequences"] == 4 * (3600 + 2 * 60), "a job's step sequences are folded too"
    endpoints = payload["results"]["endpoints"]
    assert {"overview page", "graph page", "advice page", "/api/advice", "/metrics", "ranks page",
            "/api/jobs"} <= set(endpoints)
    assert all(e["requests"] == 5 and e["bytes"] > 0 for e in endpoints.values())
    assert len(payload["targets"]) == len(endpoints)
