"""bench/window_cost.py runs as documented (a short form) and counts what it says: the flush thread's
CPU time and the statements SQLite ran while an arm served, nothing in the arm that writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_window_benchmark_counts_the_flush_threads_work_per_arm(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    done = subprocess.run(
        [sys.executable, "bench/window_cost.py", "--windows", "0.5", "--rounds", "2", "--round-s", "2.5",
         "--step-us", "500", "--trace-steps", "3000", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"no writes", "window 0.5 s"}
    quiet, written = results["no writes"], results["window 0.5 s"]
    assert len(quiet["rounds"]) == len(written["rounds"]) == 2
    assert quiet["flush_cpu_share"] == 0 and quiet["statements_per_s"] == 0
    assert written["flush_cpu_share"] > 0 and written["statements_per_s"] > 1
    assert all(r["steps_per_s"] > 0 for r in written["rounds"] + quiet["rounds"])
    assert "window 0.5 s: flush thread" in done.stdout
