"""The advice around the optimiser: cost models, budgets, the current configuration, what to paste."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inspector.advice.costs import MIB, CostModel, RecordedGraph, StepTimes
from inspector.advice.engines import DecodeTraffic, EngineLists, config_lines
from inspector.advice.recommend import advise
from inspector.advice.render import as_dict, render_text
from inspector.advice.sizes import Histogram, best_choices, project
from inspector.advice.weighing import Weighing, modelled_seconds
from inspector.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
# A run as the H200 recorded it, in shape: the largest graph grows the shared pool, smaller ones
# reuse it and add a little; FULL and piecewise graphs at each size.
GRAPHS = [RecordedGraph(size, 0.25 + 0.001 * size, (600 * MIB if size == 256 else 2 * MIB) // 2)
          for size in (1, 2, 4, 8, 16, 32, 64, 128, 256) for _mode in ("full", "piecewise")]
HISTOGRAM = Histogram.from_counts({1: 5, 3: 40, 7: 30, 12: 100, 90: 20, 200: 60, 256: 4})


def test_the_cost_model_reads_what_the_graphs_show() -> None:
    costs = CostModel.fit(GRAPHS)
    per_size = [2 * (0.25 + 0.001 * s) for s in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert costs.seconds_per_size == pytest.approx(sum(per_size) / 9)
    assert costs.capture_seconds([1, 2, 256]) == pytest.approx(3 * costs.seconds_per_size)
    # One shared pool, captured largest first: the largest graph reserves its activations, each
    # smaller one adds what it cannot reuse (2 MiB a size here, both modes together).
    pool = costs.pool
    assert pool is not None and pool.extras == tuple((s, 2.0 * MIB) for s in (1, 2, 4, 8, 16, 32, 64, 128))
    assert pool.activations_per_token == pytest.approx((600 - 2) * MIB / 256)
    assert costs.pool_bytes([256]) == pytest.approx(600 * MIB)
    assert costs.pool_bytes([128]) == pytest.approx(2 * MIB + 598 * MIB / 2)
    assert costs.pool_bytes([1, 2, 3, 256]) == pytest.approx(606 * MIB)
    described = " ".join(costs.describe())
    assert "per capture size" in described and "captured largest first" in described
    with pytest.raises(ValueError, match="no recorded graphs"):
        CostModel.fit([])


@settings(max_examples=60, deadline=None)
@given(seconds=st.floats(0.62, 20), memory=st.floats(600, 700), max_graphs=st.integers(1, 7))
def test_budgets_are_respected_and_the_advice_is_the_best_that_fits(seconds, memory, max_graphs) -> None:
    costs = CostModel.fit(GRAPHS)
    advice = advise(HISTOGRAM, [1, 2, 4, 8, 16, 32, 64, 128, 256], source="test", max_graphs=max_graphs,
                    capture_time_budget=seconds, memory_budget_bytes=memory * MIB, max_size=256, costs=costs)
    assert costs.capture_seconds(advice.sizes) <= seconds
    assert costs.pool_bytes(advice.sizes) <= memory * MIB
    assert len(advice.sizes) <= max_graphs and advice.sizes[-1] == 256
    # Nothing within the same budgets pads less: one more size would break one of them.
    by_memory = 1 + int((memory - 600) * MIB // (2 * MIB) + 1e-9)
    allowed = min(max_graphs, int(seconds // costs.seconds_per_size), by_memory)
    best = best_choices(HISTOGRAM, 256, allowed)[-1]
    assert advice.advised.traffic.padding_tokens == best.cost


def test_budgets_nothing_fits_and_budgets_without_costs_are_clear_errors() -> None:
    costs = CostModel.fit(GRAPHS)
    current = [1, 2, 4, 8]
    with pytest.raises(UsageError, match=r"capture-time budget of 0\.1 s fits no graph: one capture size"):
        advise(HISTOGRAM, current, source="t", capture_time_budget=0.1, costs=costs)
    nothing = "memory budget of 100 MiB fits no graph: the largest size, 256, needs"
    with pytest.raises(UsageError, match=nothing):
        advise(HISTOGRAM, current, source="t", memory_budget_bytes=100 * MIB, costs=costs)
    with pytest.raises(UsageError, match="needs the capture costs a run recorded"):
        advise(HISTOGRAM, current, source="t", capture_time_budget=5)


def test_degenerate_inputs_are_clear_errors() -> None:
    with pytest.raises(UsageError, match="no batches recorded"):
        advise(Histogram.of([]), [1, 2], source="empty.db")
    with pytest.raises(UsageError, match=r"--max-size 2 is below every observed batch \(the smallest is 3\)"):
        advise(Histogram.of([3, 4]), [4], source="t", max_size=2)


def test_without_limits_the_advice_keeps_the_current_graph_count_and_never_pads_more() -> None:
    current = [4, 16, 64, 128, 256]
    advice = advise(HISTOGRAM, current, source="t")
    assert advice.graphs == 5 and advice.bounded_by == "the current configuration's count (5)"
    assert advice.advised.traffic.padding_tokens <= advice.current.traffic.padding_tokens
    assert advice.advised.traffic.eager_batches == advice.current.traffic.eager_batches == 0
    assert [len(p.capture_sizes) for p in advice.curve] == list(range(1, 8)), "7 distinct sizes"
    assert advice.curve[-1].traffic.padding_tokens == 0
    few = advise(HISTOGRAM, current, source="t", max_graphs=50)
    assert few.graphs == 7 and few.bounded_by == "every candidate size (7)"


def test_padding_weighed_by_step_time_moves_sizes_to_where_padding_is_dear(tmp_path: Path) -> None:
    # Launch bound up to 64 tokens (flat), compute bound above: padding small batches costs little.
    (tmp_path / "steps.csv").write_text("size,seconds\n1,0.001\n64,0.001\n256,0.004\n")
    step_times = StepTimes.read(tmp_path / "steps.csv")
    assert [step_times(n) for n in (1, 30, 64, 160)] == pytest.approx([0.001, 0.001, 0.001, 0.0025])
    assert step_times(512) == pytest.approx(0.008), "above the measured sizes: in proportion to the tokens"
    histogram = Histogram.from_counts({3: 100, 60: 20, 130: 30, 250: 10})
    by_tokens = advise(histogram, [1, 2], source="t", max_graphs=2)
    by_time = advise(histogram, [1, 2], source="t", max_graphs=2,
                     weighing=Weighing.from_csv(step_times, "steps.csv"))
    # Counted in tokens, the hundred 3-token batches want their own graph; timed, padding them up
    # to 60 is free (launch bound), and the graph is better spent where a step is compute bound.
    assert by_tokens.sizes == (3, 250) and by_time.sizes == (60, 250)
    assert not by_tokens.weighed_by_step_time and "padding counted in tokens" in render_text(by_tokens)
    assert by_time.weighed_by_step_time and "weighed by the step times in steps.csv" in render_text(by_time)
    # A lone request pads to 60 and pays nothing for it (the curve is flat up to 64 tokens).
    assert by_time.lone_request is not None and by_time.lone_request.over_best == 0
    # By the step-time model the timed advice costs the traffic less than the token-counted one; the
    # current sizes leave batches eager, and no eager time is known: not modelled.
    assert by_time.current_seconds is None and by_time.advised_seconds == pytest.approx(
        120 * step_times(60) + 40 * step_times(250))
    weighing = Weighing.from_csv(step_times, "steps.csv")
    assert by_time.advised_seconds < modelled_seconds(histogram, by_tokens.sizes, weighing)


def test_where_step_time_is_affine_in_tokens_timed_advice_is_the_token_advice_and_says_so(tmp_path: Path
                                                                                          ) -> None:
    # a + b * n: every padding token costs the same time, so the fewest tokens are the least time.
    (tmp_path / "steps.csv").write_text("size,seconds\n1,0.0040\n256,0.0295\n")
    weighing = Weighing.from_csv(StepTimes.read(tmp_path / "steps.csv"), "steps.csv")
    histogram = Histogram.from_counts({3: 100, 60: 20, 130: 30, 250: 10, 256: 5})
    by_tokens = advise(histogram, [256], source="t", max_graphs=3, lone_request_slack=1.0)
    by_time = advise(histogram, [256], source="t", max_graphs=3, weighing=weighing, lone_request_slack=1.0)
    assert by_time.sizes == by_tokens.sizes == (3, 130, 256) and by_tokens.by_tokens is None
    alternative = by_time.by_tokens
    assert alternative is not None and alternative.sizes == by_time.sizes
    assert alternative.seconds == by_time.advised_seconds and alternative.saved(by_time.advised_seconds) == 0
    assert "by tokens alone  the same sizes: on this traffic the fewest padding tokens are also the least " \
        "modelled step time" in render_text(by_time)
    assert as_dict(by_time)["by_tokens"] == {
        "capture_sizes": [3, 130, 256], "same_sizes": True, "modelled_step_seconds": by_time.advised_seconds,
        "padding_waste": by_time.advised.traffic.padding_waste, "time_saved": 0.0}


def test_step_times_files_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("size,seconds\n4,fast\n")
    with pytest.raises(ValueError, match="line 2: expected size,seconds"):
        StepTimes.read(bad)
    bad.write_text("size,seconds\n")
    with pytest.raises(ValueError, match="no step times"):
        StepTimes.read(bad)
    noisy = tmp_path / "noisy.csv"
    noisy.write_text("1,0.002\n8,0.0015\n16,0.003\n")
    assert StepTimes.read(noisy).seconds == (0.002, 0.002, 0.003), "a step does not get cheaper as it grows"


def test_what_to_paste_is_spelled_as_each_engine_documents_it() -> None:
    lines = config_lines(EngineLists((1, 4, 16), (1, 4, 16), None))
    assert lines == {
        "vllm": """--compilation-config '{"cudagraph_capture_sizes": [1, 4, 16]}'""",
        "sglang": "--cuda-graph-bs 1 4 16",
        "sglang_prefill": None,
        "tensorrt_llm": "cuda_graph_config: {enable_padding: true, batch_sizes: [1, 4, 16]}",
        "tensorrt_llm_prefill": None,
        "capture_core": "sizes=[1, 4, 16]",
    }
    apart = config_lines(EngineLists((4, 64, 256), (2, 8), (64, 256)))
    assert apart["sglang"] == "--cuda-graph-bs 2 8" and apart["sglang_prefill"] == (
        "--piecewise-cuda-graph-tokens 64 256")
    assert apart["tensorrt_llm_prefill"] == (
        "torch_compile_config: {enable_piecewise_cuda_graph: true, capture_num_tokens: [64, 256]}")


def test_decode_steps_are_advised_in_requests_apart_from_prefill_tokens() -> None:
    # Decode steps of 2..16 requests, two tokens a request (speculative decoding), and prefill chunks
    # of 100..250 tokens: SGLang's --cuda-graph-bs never holds a chunk's tokens, and counts requests.
    decode = Histogram.from_counts({4: 50, 8: 30, 16: 20, 32: 10})
    everything = Histogram.from_counts({4: 50, 8: 30, 16: 20, 32: 10, 100: 5, 180: 8, 250: 3})
    advice = advise(everything, [8, 32, 256], source="t", max_graphs=4,
                    decode=DecodeTraffic(decode, query_len=2))
    lists = advice.engines
    assert lists is not None and lists.tokens == advice.sizes
    assert lists.decode_requests == (2, 4, 8, 16), "tokens / 2: requests"
    assert lists.prefill_tokens is not None and set(lists.prefill_tokens) <= {100, 180, 250}
    lines = as_dict(advice)["config"]
    assert lines["sglang"] == "--cuda-graph-bs 2 4 8 16"
    assert "decodes 2 tokens per request" in render_text(advice)
    # Where the decode steps are not told apart, the decode lines are left out, and it says why.
    untold = advise(everything, [8, 32, 256], source="t", max_graphs=4)
    data = as_dict(untold)
    assert data["config"]["sglang"] is None and data["config"]["tensorrt_llm"] is None
    assert "not told apart" in data["config_notes"][0] and "not told apart" in render_text(untold)


def test_the_text_and_the_json_say_the_same() -> None:
    costs = CostModel.fit(GRAPHS)
    advice = advise(HISTOGRAM, [1, 2, 4, 8, 16, 32, 64, 128, 256], source="demo.db (run 1)", costs=costs)
    data = as_dict(advice)
    assert data["advised"]["capture_sizes"] == list(advice.sizes)
    assert data["advised"]["traffic"] == project(HISTOGRAM, advice.sizes).traffic.as_dict()
    assert data["current"]["graphs"] == 9 and data["histogram"]["batches"] == HISTOGRAM.total
    assert [p["graphs"] for p in data["curve"]] == list(range(1, 8))
    assert data["advised"]["capture_seconds"] == costs.capture_seconds(advice.sizes)
    assert data["config"] == config_lines(EngineLists(advice.sizes, None, None))
    assert data["config"]["vllm"] == config_lines(EngineLists(advice.sizes, None, None))["vllm"]
    json.dumps(data)  # every field serialises
    text = render_text(advice)
    for piece in ("advised sizes    " + ", ".join(map(str, advice.sizes)), "padding waste", "hit ratio",
                  "capture time", "pool memory", "waste by graphs  1: ", "cost model", "vLLM", "SGLang",
                  "TensorRT-LLM", data["config"]["vllm"]):
        assert piece in text, piece


def run_advise(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "dashboard.cli", "advise", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_advise_on_the_packaged_trace_beats_vllm_s_list_at_its_own_graph_count() -> None:
    result = run_advise("--trace", "--steps", "3000", "--speedup", "8", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["graphs"] == data["current"]["graphs"] == 35
    advised, current = data["advised"]["traffic"], data["current"]["traffic"]
    assert advised["padding_waste"] < current["padding_waste"] / 2
    assert advised["eager_batches"] == current["eager_batches"] == 0
    assert data["source"].startswith("azure_conv_2023.csv (19,366 requests at 8x")
    assert data["cost_model"] is None


@pytest.mark.parametrize(("args", "message"), [
    (["--trace", "missing.csv"], "--trace: missing.csv: trace file not found"),
    (["--trace", "--max-size", "300"], "--max-size 300 is above the engine's largest batch (256"),
    (["--trace", "--memory-budget", "100"], "needs the capture costs a run recorded"),
    (["--trace", "--current", "4,four"], "'four' is not a size"),
    (["--trace", "--max-graphs", "0"], "--max-graphs: must be between 1"),
    (["--trace", "--step-times", "missing.csv"], "--step-times: missing.csv: cannot read the step times"),
])
def test_advise_refuses_what_it_cannot_do_in_one_line(args: list[str], message: str) -> None:
    result = run_advise(*args, "--steps", "50")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
