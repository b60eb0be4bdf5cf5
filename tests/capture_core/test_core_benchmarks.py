"""The capture core's benchmark scripts, run as real processes in their quick/small forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.faults import ALWAYS_ON, KINDS

REPO = Path(__file__).resolve().parents[2]


def run_script(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_gpu_core_quick_records_every_section(tmp_path):
    out = tmp_path / "gpu_core.json"
    stdout = run_script("bench/gpu_core.py", "--quick", "--out", str(out))
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert payload["benchmark"] == "gpu_core" and payload["config"]["quick"] is True
    assert [g["bucket"] for g in results["per_graph"]] == [1, 2, 4]
    assert all(g["capture_s"] > 0 for g in results["per_graph"])
    assert {r["bucket"] for r in results["replay_vs_eager"]} == {1, 2, 4}
    assert all(r["max_abs_err_same_padded_inputs"] <= 1e-4 for r in results["replay_vs_eager"])
    assert [r["bucket"] for r in results["check_cost_per_step"]] == [1, 2, 4]
    assert all(h["inputs_checked"] == 4 for h in results["wrapper_host_cost"])
    if payload["config"]["backend"] == "eager":
        assert results["memory"] == {} and any("needs a CUDA device" in n for n in payload["notes"])
    assert "Replay vs eager" in stdout and "Targets" in stdout


def test_check_cost_times_every_check_over_the_runner_inputs(tmp_path):
    out = tmp_path / "check_cost.json"
    stdout = run_script("bench/check_cost.py", "--calls", "200", "--repeats", "3", "--out", str(out))
    rows = {(r["section"], r["what"]): r for r in json.loads(out.read_text())["results"]}
    guard = "replay guard, runner graph"
    assert rows[(guard, "addresses + layouts (identity of every tensor input)")]["inputs"] == 4
    assert (guard, "+ stale inputs (3 version counters, padding rows): the runner's") in rows
    baked = "baked values (3 Python arguments, 3 module attributes)"
    assert rows[(baked, "replay guard with the baked values")]["inputs"] == 2
    assert rows[("kv_caches list of 80 layers", "replay guard")]["inputs"] == 83
    assert rows[("nested inputs (a dataclass of 4 tensors, a dict of 2)", "replay guard")]["inputs"] == 8
    wrapper = "wrapper call, replay stubbed (runner graph)"
    assert rows[(wrapper, "ALWAYS_ON - OFF: every check as a step pays")]["ns_per_call"] is not None
    assert any(what.startswith("sampled replay:") for _, what in rows)
    assert "Replay checks on the host" in stdout


@pytest.mark.slow
def test_gpu_checks_quick_reports_clean_traffic_first_then_every_planted_fault_and_the_costs(tmp_path):
    out = tmp_path / "gpu_checks.json"
    stdout = run_script("bench/gpu_checks.py", "--quick", "--budget-s", "120", "--out", str(out))
    payload = json.loads(out.read_text())
    results = ["clean_traffic", "planted_faults", "legitimate_patterns", "sampled_step"]
    assert list(payload["results"]) == results
    sampled, traffic = payload["results"]["sampled_step"], payload["results"]["clean_traffic"]
    assert {r["variant"] for r in sampled} == {
        "no replay sampled", "every replay sampled", "every replay sampled, canary on",
        "the eager step alone (for reference)",
    }
    assert {(r["runner"], r["mode"]) for r in traffic} == {
        (runner, mode) for runner in ("decode", "mixed piecewise", "micro-batched decode")
        for mode in ("always_on", "debug")
    }
    config = payload["config"]
    wanted = {"always_on": config["replays_wanted"], "debug": config["debug_replays_wanted"]}
    assert all(r["violations"] == 0 and r["replays"] >= wanted[r["mode"]] for r in traffic)
    faults = payload["results"]["planted_faults"]
    assert {(r["graph"], r["fault"]) for r in faults} == {(g, f) for g in KINDS for f in ALWAYS_ON}
    assert all(r["caught"] and r["false_alarms_before"] == 0 for r in faults)
    # Every fault of the suite is caught at the first faulty step, no sampled replay needed (the
    # baked host values by the guard's baked-value comparison, not the canary).
    assert {r["faulty_steps"] for r in faults} == {1}
    legit = payload["results"]["legitimate_patterns"]
    assert {r["graph"] for r in legit} == set(KINDS) and all(r["violations"] == 0 for r in legit)
    assert {r["pattern"] for r in legit} >= {"in-graph sampling", "inputs_written_unseen (inference mode)"}
    assert all(t["met"] is not False for t in payload["targets"])
    assert stdout.index("Clean traffic with every check on") < stdout.index("Planted faults")


@pytest.mark.slow
def test_runner_host_times_a_step_in_each_tree_and_mode(tmp_path):
    out = tmp_path / "runner_host.json"
    stdout = run_script("bench/runner_host.py", "--quick", "--against", str(REPO), "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert {(r["tree"], r["mode"], r["batch"]) for r in rows} == {
        (tree, mode, batch) for tree in ("this tree", f"against {REPO}") for mode in ("off", "always_on")
        for batch in (1, 4, 16)
    }
    assert all(0 < r["p10_us"] <= r["median_us"] <= r["p90_us"] for r in rows)
    assert "replay stubbed" in stdout
