"""bench/gpu_watch.py as a real process: on a host without CUDA it says so and still writes JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the benchmark itself")
def test_gpu_watch_on_a_cpu_host_records_why_nothing_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "gpu_watch.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_watch.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "gpu_watch" and payload["targets"] == []
    skipped = [note.split(":")[0] for note in payload["notes"]]
    assert skipped == ["decode loop", "torch.compile", "replay overhead"]
    assert "needs a CUDA device" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the benchmark itself")
def test_gpu_transformers_on_a_cpu_runs_pairs_and_alternating_processes_and_says_what_it_skipped(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_transformers.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_transformers.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert payload["benchmark"] == "gpu_transformers" and results["failed"] == 0
    assert [(c["mode"], c["batch"], c["tokens_identical"]) for c in results["cells"]] == [
        ("eager", 1, True), ("eager", 2, True)
    ]
    assert sorted(p["variant"] for p in results["processes"]) == ["bare", "paired", "watched"]
    assert all(c["bare"]["processes"] == c["watched"]["processes"] == 1 for c in results["cells"])
    assert set(results["cpus"]) <= set(os.sched_getaffinity(0))
    assert all(p["cpus"] == results["cpus"] for p in results["processes"] if "cpus" in p)  # pinned alike
    paired = results["paired"]["eager"]
    assert paired["measured"] and paired["tokens_identical"] and set(paired["batches"]) == {"1", "2"}
    cpu = paired["cpu"]
    assert cpu["pairs"] == 3 and cpu["low"] <= cpu["ratio"] <= cpu["high"]
    arms = paired["watched_arms"]
    assert (arms["arms"], arms["captures"], arms["watch_errors"]) == (6, 0, 0)  # a CPU captures no graph
    assert paired["accounted"]["total"] == 0.0 and results["watch_threads_cpu_share"]["eager"] == 0.0
    assert results["judged"]["eager"] == 1.0  # no graph: the watch ran nothing in the program
    (note,) = payload["notes"]
    assert note.startswith("compiled mode needs a CUDA device")
    met = {t["name"].split(" ")[1]: t["met"] for t in payload["targets"] if t["name"].startswith("eager:")}
    assert met == {"accounted": None, "paired": None}  # a CPU's figure neither meets nor misses a GPU target
    (tokens,) = [t for t in payload["targets"] if t["name"].startswith("batch sizes whose tokens differ")]
    assert tokens["met"] is True
    assert "Phase 1, in-process pairs" in result.stdout and "Phase 2, alternating processes" in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1])["out"] == str(out)


def test_gpu_transformers_counts_a_batch_whose_tokens_differ_in_any_process_pairs_included() -> None:
    from bench.gpu_transformers import make_targets, summarise

    def run(variant: str, tokens: str, **extra: object) -> dict:
        timing = {"ms_per_token": 1.0, "cpu_ms_per_token": 1.0, "first_s": 1.0, "tokens_stable": True}
        cells = {"1": timing | {"tokens": tokens}}
        return {"mode": "eager", "variant": variant, "round": 0, "batches": cells, **extra}

    def paired(tokens: str) -> dict:
        arms = {"arms": 2, "captures": 0, "replays": 0, "hook_seconds": 0.0, "cpu_s": 2.0,
                "watch_errors": 0, "sink_errors": 0}
        times = {"wall_s": [1.0, 1.0], "cpu_s": [1.0, 1.0]}
        cell = {"bare": times, "watched": times, "tokens_identical": True, "tokens": tokens}
        return {"mode": "eager", "variant": "paired", "round": -1, "pairs": 2, "batches": {"1": cell},
                "watched_arms": arms, "replay_hook_us": None}

    def differing(processes: list[dict]) -> int:
        (check,) = [t for t in make_targets(summarise(processes, ["eager"], [1]), ["eager"], applies=True)
                    if t["name"].startswith("batch sizes whose tokens differ")]
        return check["value"]

    watched = {"watch": {"threads_cpu_per_s": 0.0, "graph_pool_bytes": {}}}
    assert differing([run("bare", "a"), run("watched", "a", **watched), paired("a")]) == 0
    assert differing([run("bare", "a"), run("watched", "a", **watched), paired("b")]) == 1
    assert differing([run("bare", "a"), run("watched", "b", **watched), paired("a")]) == 1
