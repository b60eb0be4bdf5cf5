"""bench/gpu_transformers_cb.py: its workload from the trace, its figures, and its ``--quick`` form as
real processes (on this CPU host every step runs eagerly: transformers turns CUDA graphs off)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_transformers_cb import (
    Pass,
    alternation,
    arrival_waves,
    expected_real_tokens,
    figures,
    on_in,
    read_back,
    recorded_summary,
    trace_requests,
)
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.engines.transformers_cb.keys import CBKey
from inspector.engines.transformers_cb.ledger import Ledger
from inspector.recording.recorder import Recorder
from inspector.watch.flush import WatchFlusher
from inspector.watch.identity import CapturedInputs

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_requests_take_the_traces_arrivals_and_lengths_scaled_and_clamped() -> None:
    requests = trace_requests(50, prompt_scale=8, output_scale=4, max_prompt=512, max_output=96, vocab=1000)
    from capture_core.reference.trace import load_trace

    rows = load_trace().requests[:50]
    assert [r.arrival_s for r in requests] == [row.arrival_s for row in rows]
    for request, row in zip(requests, rows, strict=True):
        assert len(request.prompt) == min(max(round(row.context_tokens / 8), 4), 512)
        assert request.max_new_tokens == min(max(round(row.generated_tokens / 4), 2), 96)
        assert all(3 <= t < 1000 for t in request.prompt)
    assert trace_requests(50, prompt_scale=8, output_scale=4, max_prompt=512, max_output=96, vocab=1000) \
        == requests  # the same prompts in every process


def test_waves_group_requests_by_arrival_in_order() -> None:
    requests = trace_requests(60, prompt_scale=8, output_scale=4, max_prompt=64, max_output=8, vocab=100)
    waves = arrival_waves(requests, 5.0)
    assert [r for wave in waves for r in wave] == requests
    windows = [{int(r.arrival_s // 5.0) for r in wave} for wave in waves]
    assert all(len(w) == 1 for w in windows) and [min(w) for w in windows] == sorted(min(w) for w in windows)
    assert expected_real_tokens(requests) == sum(len(r.prompt) + r.max_new_tokens - 1 for r in requests)


def _process(variant: str, round_index: int, cold: str, warm: str, tps: float) -> dict:
    passes = {name: {"tokens": digest, "tokens_per_s": tps, "seconds": 1.0, "generated": int(tps)}
              for name, digest in (("cold", cold), ("warm", warm))}
    return {"variant": variant, "round": round_index, "passes": passes, "built_s": 1.0, "warmup_s": 2.0}


def test_the_figures_are_medians_over_processes_and_one_differing_token_fails_identity() -> None:
    processes = [_process("bare", 0, "a", "b", 100.0), _process("attached", 0, "a", "b", 99.0),
                 _process("attached", 1, "a", "b", 98.0), _process("bare", 1, "a", "b", 102.0)]
    results = figures(processes)
    assert results["tokens_identical"] == {"cold": True, "warm": True}
    warm = results["tokens_per_s"]["warm"]
    assert (warm["bare"], warm["attached"]) == (101.0, 98.5)
    assert warm["ratio"] == pytest.approx(98.5 / 101.0)
    assert warm["round_ratios"] == pytest.approx([0.99, 98.0 / 102.0])
    processes[2]["passes"]["warm"]["tokens"] = "c"
    assert figures(processes)["tokens_identical"] == {"cold": True, "warm": False}
    failed = figures([*processes[:2], {"variant": "bare", "round": 2, "failed": 1}])
    assert failed["failed"] == 1 and failed["tokens_identical"] == {"cold": False, "warm": False}


def test_a_run_with_graphs_is_read_back_from_the_database_and_checked_against_transformers_keys(
    tmp_path: Path,
) -> None:
    """What an attached process reads back and sums up on the GPU, here from rows the real Recorder
    and flusher wrote for a ledger's graphs (a CPU captures none through transformers)."""
    url = f"sqlite:///{tmp_path / 'cb.db'}"
    ledger = Ledger()
    recorder = Recorder(url, label="read back", config={"source": "transformers continuous batching"}).start()
    flusher = WatchFlusher(recorder, ledger.graphs, interval=60)
    try:
        for key, late, pool in (((64, 16384, 16384), False, 1 << 20), ((16, 4096, 1024), True, 4096)):
            graph, event = ledger.captured(CBKey(key, False, 16), seconds=0.5 if late else 2.0,
                                           pool_bytes=pool, late=late, inputs=CapturedInputs())
            flusher.add_record(event)
            if late:
                recorder.on_eager(EagerReason.UNEXPECTED_CAPTURE, 9, CUDAGraphMode.FULL)
                graph.replays_by_real_tokens.update({9: 3, 16: 1})
        assert flusher.flush_once()
    finally:
        flusher.close()
        recorder.close()

    recorded = read_back(url, recorder.run_id)
    assert recorded["config"] == {"source": "transformers continuous batching"}
    assert [(g["key"], g["unexpected"], g["replays"], g["num_real_tokens"], g["padding_tokens"])
            for g in recorded["by_graph"]] == [("varlen q=64 kv=16384 k=16384", False, 0, 0, 0),
                                               ("varlen q=16 kv=4096 k=1024", True, 4, 43, 64 - 43)]
    assert [g["engine_key"] for g in recorded["by_graph"]] == ["(64, 16384, 16384)", "(16, 4096, 1024)"]
    assert recorded["eager"] == [{"reason": "unexpected_capture", "batches": 1, "num_real_tokens": 9}]
    assert recorded["traffic"]["replays"] == 4 and recorded["traffic"]["hit_ratio"] == 4 / 5
    process = {"recorded": recorded, "integration": {"errors": 0, "by_graph": ledger.summary()["by_graph"]},
               "expected_real_tokens_per_pass": 26, "pool_reserved_bytes": (1 << 20) + 4096,
               "graph_keys": [[None, [16, 4096, 1024]], [None, [64, 16384, 16384]]]}
    summary = recorded_summary(process)
    assert (summary["graphs"], summary["start_up_graphs"], summary["late_captures"]) == (2, 1, 1)
    assert (summary["late_capture_seconds"], summary["start_up_capture_seconds"]) == (0.5, 2.0)
    assert summary["num_real_tokens"] == 43 + 9 == summary["expected_real_tokens"]
    assert summary["pool_bytes"] == summary["pool_reserved_bytes"] and summary["keys_match"]
    process["graph_keys"] = [[None, [64, 16384, 16384]]]
    assert not recorded_summary(process)["keys_match"]


def test_alternating_passes_serve_each_wave_once_on_and_once_paused_and_compare_them() -> None:
    assert [on_in(1, wave) for wave in range(4)] == [True, False, True, False]
    assert [on_in(2, wave) for wave in range(4)] == [False, True, False, True]
    tokens = {"a": [1, 2], "b": [3]}
    # waves 0 and 2 on in the first pass, 1 and 3 in the second; on is 10% slower in every wave
    first = Pass(tokens, 0.0, 0, waves=[(1.1, 10), (2.0, 20), (1.1, 10), (4.0, 40)])
    second = Pass(dict(tokens), 0.0, 0, waves=[(1.0, 10), (2.2, 20), (1.0, 10), (4.4, 40)])
    compared = alternation([first, second])
    assert compared["wave_ratios"] == [round(1 / 1.1, 4)] * 4
    assert compared["median_wave_ratio"] == pytest.approx(1 / 1.1)
    assert compared["ratio_over_all_waves"] == pytest.approx(8.0 / 8.8)
    assert compared["tokens_identical"]
    second.tokens = {"a": [1, 2], "b": [4]}
    assert not alternation([first, second])["tokens_identical"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the benchmark is the CUDA run itself")
def test_quick_runs_bare_and_attached_processes_with_the_same_tokens_and_every_step(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "cb.json"
    result = subprocess.run([sys.executable, "bench/gpu_transformers_cb.py", "--quick", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert payload["benchmark"] == "gpu_transformers_cb" and results["failed"] == 0
    assert sorted(p["variant"] for p in results["processes"]) == ["alternating", "attached", "bare"]
    assert results["tokens_identical"] == {"cold": True, "warm": True}
    within = results["within_process"]
    assert within["tokens_identical"] and within["waves"] == len(within["processes"][0]["wave_ratios"]) > 0
    recorded = results["recorded"]
    assert recorded["num_real_tokens"] == recorded["expected_real_tokens"] > 0
    assert recorded["graphs"] == 0 and set(recorded["eager_batches"]) == {"mode_none"}
    assert recorded["config"]["source"] == "transformers continuous batching"
    assert recorded["keys_match"] and recorded["integration_errors"] == 0 and recorded["violations"] == 0
    assert payload["targets"][0]["met"] is None  # a CPU's figures judge nothing
    assert "\nTargets\n" in result.stdout and Path(results["db"].removeprefix("sqlite:///")).exists()
