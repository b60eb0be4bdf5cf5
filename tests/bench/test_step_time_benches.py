"""bench/gpu_step_time.py, bench/advice_time.py and bench/gpu_memory_forecast.py run as documented
(their quick forms, as real processes), and what they write hangs together: a step-time curve per
model that the advice reads, a forecast per list beside its real capture."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ON_CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.slow


def run(script: str, *args: str) -> tuple[dict, str]:
    out = Path(args[args.index("--out") + 1])
    done = subprocess.run([sys.executable, f"bench/{script}.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_the_step_time_benchmark_times_every_size_both_ways_and_writes_its_curve(tmp_path: Path) -> None:
    payload, stdout = run("gpu_step_time", "--quick", "--out", str(tmp_path / "gpu_step_time.json"))
    (result,) = payload["results"]
    assert result["model"] == "tiny" and result["violations"] == 0
    assert result["clocks"] == (["cuda_events"] if ON_CUDA else ["host_clock"])
    for row in result["sizes"]:
        assert row["graph_samples"] == row["eager_samples"] == 3
        assert row["graph_seconds"] > 0 and row["eager_seconds"] > 0 and row["speedup"] > 0
        # The recorder wrote what the cache timed: its means sit between the samples' extremes.
        assert row["recorded_mean"]["graph_seconds"] > 0 and row["recorded_mean"]["eager_seconds"] > 0
        assert row["bench_runner_step_seconds"] > 0 and row["bench_eager_seconds"] > 0
    with open(tmp_path / "step_times_tiny.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["size", "graph_seconds", "eager_seconds"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "4"]
    assert [row["graphs"] for row in result["advice"]] == [9, 35]
    assert "Targets" in stdout
    if not ON_CUDA:
        assert all(t["met"] is None for t in payload["targets"])
        assert "the eager backend stands in" in payload["notes"][0]


def test_the_advice_on_time_benchmark_judges_both_advices_by_the_step_time_model(tmp_path: Path) -> None:
    curve = tmp_path / "curve.csv"
    # Flat (launch-bound) up to 64 tokens, then steeper: padding small batches is free.
    curve.write_text("size,graph_seconds,eager_seconds\n1,0.0005,0.004\n64,0.0005,0.005\n256,0.002,0.009\n")
    payload, stdout = run("advice_time", "--step-times", str(curve), "--steps", "200",
                          "--out", str(tmp_path / "advice_time.json"))
    rows = {row["graphs"]: row for row in payload["results"]["rows"]}
    assert sorted(rows) == [9, 35]
    for row in rows.values():
        assert row["time"]["modelled_step_seconds"] <= row["tokens"]["modelled_step_seconds"]
        assert row["time"]["lone_request_over_best"] <= 0.05
        assert len(row["time"]["sizes"]) == len(row["tokens"]["sizes"]) == row["graphs"]
    assert all(t["met"] is not None for t in payload["targets"]), "a real curve: the targets are judged"
    assert "modelled step time summed" in stdout
    bad = subprocess.run([sys.executable, "bench/advice_time.py", "--out", str(tmp_path / "x.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--step-times CSV is needed" in bad.stderr


def test_the_memory_forecast_benchmark_forecasts_each_list_beside_its_real_capture(tmp_path: Path) -> None:
    out = tmp_path / "gpu_memory_forecast.json"
    payload, stdout = run("gpu_memory_forecast", "--quick", "--out", str(out))
    (result,) = payload["results"]
    lists = {row["list"]: row for row in result["lists"]}
    assert list(lists) == ["recorded list", "recorded list, captured again", "powers of two",
                           "advised, 2 graphs", "advised, 3 graphs"]
    assert sorted(int(size) for size in result["recorded_pool_bytes"]) == [1, 2, 4, 8]
    assert lists["recorded list"]["sizes"] == [1, 2, 4, 8] and len(lists["advised, 3 graphs"]["sizes"]) == 3
    if ON_CUDA:
        assert all(row["real_bytes"] > 0 and row["forecast_bytes"] > 0 for row in lists.values())
        assert abs(lists["recorded list"]["error"]) < 0.1, "the recorded list comes out near its record"
    else:
        assert all(row["forecast_bytes"] is None for row in lists.values())
        assert all(t["met"] is None for t in payload["targets"]) and "no graph pool" in payload["notes"][0]
    assert "Targets" in stdout
