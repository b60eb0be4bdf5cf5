"""bench/advice.py runs as documented (its quick form), and its figures hang together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_advice_benchmark_compares_at_every_graph_count_and_times_it(tmp_path: Path) -> None:
    out = tmp_path / "advice.json"
    done = subprocess.run([sys.executable, "bench/advice.py", "--quick", "--repeats", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "advice" and payload["config"]["quick"] is True
    results = payload["results"]
    waste = {row["graphs"]: row for row in results["waste"]}
    assert sorted(waste) == [9, 16, 35, 67]
    assert waste[9]["advised"] < waste[9]["pow2"] and waste[35]["advised"] < waste[35]["vllm"]
    curve = [waste[k]["advised"] for k in (9, 16, 35, 67)]
    assert curve == sorted(curve, reverse=True), "more graphs, less waste"
    assert len(waste[67]["advised_sizes"]) == 67
    assert [row["speedup"] for row in results["per_load"]] == [0.05, 0.25, 1.0, 2.0, 4.0, 8.0, 11.0]
    assert all(row["advised_pow2"] <= row["pow2"] for row in results["per_load"])
    assert payload["config"]["timed_batches"] == 20_000 and len(results["advise_seconds"]) == 2
    assert [t["name"] for t in payload["targets"]][-1] == "seconds to advise on 20,000 batches"
    assert "Targets" in done.stdout
