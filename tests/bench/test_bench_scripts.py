"""Each GPU benchmark's ``--quick`` form, run as a real process: it exercises every code path.

On this CPU host the eager backend stands in and the CUDA-only parts say they were skipped; on a
GPU host the same tests run the CUDA paths (bare graphs, the compile peer, pool memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
ON_CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.slow


def run_quick(name: str, folder: Path) -> tuple[dict, str]:
    out = folder / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == name
    assert payload["command"].startswith(f"python3 bench/{name}.py --quick")
    assert payload["config"]["quick"] is True
    # The table of targets comes last, as every benchmark promises.
    assert "\nTargets\n" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith(payload["targets"][-1]["name"][:20])
    return payload, proc.stdout


def summarize(folder: Path) -> subprocess.CompletedProcess[str]:
    """``bench/summarize.py FOLDER`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "bench/summarize.py", str(folder)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def run_gpu(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``bench/run_gpu.sh OUT`` as a user runs it, with ``env`` (BENCH_ONLY, BENCH_EXTRA)."""
    return subprocess.run(
        ["bash", "bench/run_gpu.sh", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[dict, str]]]:
    """The three benchmarks' --quick runs, once for this module, into one results folder."""
    folder = tmp_path_factory.mktemp("results")
    return folder, {name: run_quick(name, folder) for name in ("gpu_decode", "gpu_overhead", "gpu_capture")}


def test_decode_quick_times_every_variant_at_every_size(quick_results) -> None:
    payload, stdout = quick_results[1]["gpu_decode"]
    (result,) = payload["results"]
    assert result["model"] == "tiny"
    assert [s["batch"] for s in result["sizes"]] == [1, 2, 4]
    expected = {"eager", "runner", "+check", "+debug"} | ({"bare", "compile"} if ON_CUDA else set())
    for size in result["sizes"]:
        assert set(size["variants"]) == expected
        assert all(v["median_ms"] > 0 for v in size["variants"].values())
        assert size["baseline"] == ("bare" if ON_CUDA else "eager")
        assert size["ratio_to_baseline"][size["baseline"]] == 1.0
        assert set(size["host_us_per_step"]) == {"runner", "+check"} | ({"bare"} if ON_CUDA else set())
        assert size["check_host_us"] > 0
        # Every variant computed the same logits as eager, so its timing is of the same work.
        assert set(size["max_rel_err_vs_eager"]) == expected - {"eager"}
        assert all(err <= 0.05 for err in size["max_rel_err_vs_eager"].values())
    if ON_CUDA:
        assert {"graphs_captured", "cudagraph_skips", "skip_reasons"} <= set(result["compile"])
    else:
        assert any("torch.compile" in n and "CUDA" in n for n in payload["notes"])
        assert all(t["met"] is None for t in payload["targets"])
    assert "Decode step, tiny" in stdout


def test_overhead_quick_compares_wrapper_variants_to_bare(quick_results) -> None:
    payload, _ = quick_results[1]["gpu_overhead"]
    rows = {r["variant"]: r for r in payload["results"]}
    assert set(rows) == {
        "bare replay()",
        "wrapper, check off",
        "wrapper, always-on check",
        "wrapper, always-on + module state",
        "wrapper, always-on + module state + stale input",
        "wrapper, debug mode (every check, the canary)",
        "wrapper, always-on + recorder",
        "wrapper + forward context per call",
    } | ({"bare replay(), torch's C method"} if ON_CUDA else set())
    assert rows["bare replay()"]["added_us"] == 0.0
    assert all(r["median_us"] > 0 for r in rows.values())
    assert payload["config"]["backend"] == ("cuda" if ON_CUDA else "eager")
    (goal,) = payload["targets"]
    assert goal["value"] == rows["wrapper, always-on check"]["added_us"]


def test_capture_quick_reports_times_and_pool_memory_where_it_can(quick_results) -> None:
    payload, _ = quick_results[1]["gpu_capture"]
    (result,) = payload["results"]
    assert result["core_capture_s_median"] > 0
    assert len(result["core_capture_s"]) == result["rounds"] >= 1
    if ON_CUDA:
        memory = result["memory"]["core"]
        assert memory["shared_pool_bytes"] > 0
        assert memory["pool_per_graph_bytes"] >= memory["largest_graph_alone_bytes"] > 0
        assert result["time_ratio"] > 0
        assert result["pool_measurement_s"] == 2 * 3 * result["snapshot_s_median"] > 0
    else:
        assert "memory" not in result
        assert any("pool-memory" in n for n in payload["notes"])


def test_ubatch_quick_compares_overlapped_and_in_line_graphs_of_the_same_split(tmp_path: Path) -> None:
    payload, stdout = run_quick("gpu_ubatch", tmp_path)
    cases = payload["results"]["cases"]
    labels = [c["case"] for c in cases]
    assert labels[:2] == ["receive copy only", "copy 0.25 MiB"]
    graphs = {"ubatched, overlapped", "ubatched, in line", "ubatched, compute only", "whole, in line"}
    for case in cases:
        assert case["num_ubatches"] == 2 and case["ubatch_slices"] == [[0, 8, 0, 8], [8, 16, 8, 16]]
        assert graphs | {"whole, compute only", "eager"} == set(case["step_ms"])
        assert all(v["median_ms"] > 0 for v in case["step_ms"].values())
        assert case["equality"]["equal_to_eager"] is True
        assert case["equality"]["max_abs_err_overlapped_vs_in_line"] <= case["equality"]["allowed_abs_err"]
    if ON_CUDA:
        assert labels[2:] == ["wait 10 us"]
        profile = cases[2]["profile"]
        assert profile["ubatched, overlapped"]["comm_activities_per_replay"] == 4  # 2 layers x 2 ubatches
        assert profile["ubatched, in line"]["comm_under_compute_us"] == 0
        assert any(t["name"].startswith("ubatched overlapped / in line") for t in payload["targets"])
    else:
        assert len(cases) == 2 and all("overlap" not in c for c in cases)
        assert any("overlap figures" in n for n in payload["notes"])
    assert "Summary (medians, ms; comm hidden" in stdout
    summary = summarize(tmp_path)
    assert summary.returncode == 0, summary.stderr
    assert "Micro-batching, tiny (0.1M params), 16 tokens in 2 ubatches (medians)" in summary.stdout
    lines = summary.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("| receive copy", "| copy 0.25"))]
    assert len(rows) == 2 and all(row.rstrip().endswith("| True |") for row in rows)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--payload-mib", "1,x"], "--payload-mib takes comma-separated numbers"),
        (["--wait-us", "-3"], "--wait-us values must be >= 0"),
        (["--tokens", "100000"], "exceeds the model's"),
    ],
)
def test_ubatch_bad_options_get_one_line_errors(option: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/gpu_ubatch.py", *option, "--out", str(tmp_path / "u.json")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "u.json").exists()


def test_summarize_turns_the_results_folder_into_markdown(quick_results) -> None:
    folder, results = quick_results
    proc = summarize(folder)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "| benchmark | command | machine | date (UTC) | figures | targets |"
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:5]}
    assert set(rows) == {"gpu_capture", "gpu_decode", "gpu_overhead"}
    decode = results["gpu_decode"][0]
    assert decode["machine"]["date_utc"][:10] in rows["gpu_decode"]
    assert f"`{decode['command']}`" in rows["gpu_decode"]
    assert "Decode step, tiny" in proc.stdout
    assert "| bare replay() |" in proc.stdout
    # One verdict for the overhead target: met or missed on a GPU, not applicable on a CPU stand-in.
    verdicts = [word in rows["gpu_overhead"] for word in ("(met", "MISSED", "(n/a)")]
    assert verdicts.count(True) == 1
    assert verdicts[2] is not ON_CUDA


def test_summarize_refuses_a_folder_without_results(tmp_path: Path) -> None:
    proc = summarize(tmp_path)
    assert proc.returncode == 2
    assert "no benchmark JSON" in proc.stderr


def test_run_gpu_continues_past_failures_and_summarises(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_ONLY": "gpu_overhead gpu_capture", "BENCH_EXTRA": "--no-such-option"}
    proc = run_gpu(tmp_path / "out", env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = proc.stdout[proc.stdout.index("GPU benchmarks:") :]
    assert "gpu_overhead   FAILED (exit 2)" in summary
    assert "gpu_capture    FAILED (exit 2)" in summary
    assert "gpu_decode" not in summary
    assert (tmp_path / "out" / "machine.txt").read_text().startswith("date_utc:")
    assert "unrecognized arguments: --no-such-option" in (tmp_path / "out" / "gpu_overhead.log").read_text()


def test_run_gpu_passes_when_every_selected_benchmark_succeeds(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_ONLY": "gpu_overhead", "BENCH_EXTRA": "--quick"}
    proc = run_gpu(tmp_path / "out", env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_overhead   ok" in proc.stdout
    assert json.loads((tmp_path / "out" / "gpu_overhead.json").read_text())["benchmark"] == "gpu_overhead"


def test_decode_keeps_the_other_models_figures_when_one_fails(tmp_path: Path, monkeypatch) -> None:
    """An out-of-memory on one model must not cost the whole run: its figures go, the rest stay."""
    from bench import gpu_decode

    real = gpu_decode.measure_model
    calls = []

    def first_model_fails(name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 25.88 GiB\nmore detail")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(gpu_decode, "measure_model", first_model_fails)
    out = tmp_path / "decode.json"
    models = ["--models", "tiny", "tiny", "--compile-models"]
    argv = [*models, "--max-batch", "1", "--rounds", "2", "--iters", "2", "--out", str(out)]
    assert gpu_decode.main(argv) == 1
    payload = json.loads(out.read_text())
    assert len(payload["results"]) == 1
    assert [s["batch"] for s in payload["results"][0]["sizes"]] == [1]
    assert payload["config"]["failed_models"] == ["tiny"]
    assert (
        "tiny: FAILED, no figures: RuntimeError: CUDA out of memory. Tried to allocate 25.88 GiB"
        in payload["notes"]
    )
