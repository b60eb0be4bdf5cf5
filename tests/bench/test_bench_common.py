"""The shared benchmark helpers: statistics, timers, budgets, tables and the JSON record."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from bench import common
from bench.gpu_decode import watch_graph_trees


def test_stats_median_and_interpolated_quantiles() -> None:
    stats = common.Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (stats.median, stats.n) == (3.0, 5)
    assert stats.p10 == pytest.approx(1.4)
    assert stats.p90 == pytest.approx(4.6)
    assert common.Stats.of([7.0]).as_dict("us") == {
        "median_us": 7.0,
        "p10_us": 7.0,
        "p90_us": 7.0,
        "samples": 1,
    }


def test_stats_refuse_no_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        common.Stats.of([])


def test_call_timer_on_cpu_times_each_call() -> None:
    timer = common.CallTimer(torch.device("cpu"))
    assert not timer.uses_cuda_events
    samples = timer.time_calls(lambda: time.sleep(0.002), 3)
    assert len(samples) == 3
    assert all(1.5 <= s < 500 for s in samples), samples
    with pytest.raises(ValueError, match="iters"):
        timer.time_calls(lambda: None, 0)


def test_time_interleaved_runs_every_variant_in_rounds() -> None:
    order: list[str] = []
    variants = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    samples = common.time_interleaved(
        variants, common.CallTimer(torch.device("cpu")), rounds=2, iters=3, warmup=1, rotate=False
    )
    assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 6}
    # Warm-ups first, then rounds that alternate the variants: a a a b b b a a a b b b.
    assert order == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3


def test_time_interleaved_rotates_rounds_warms_blocks_and_takes_lengths_per_variant() -> None:
    order: list[str] = []
    variants = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    samples = common.time_interleaved(
        variants,
        common.CallTimer(torch.device("cpu")),
        rounds=3,
        iters={"a": 2, "b": 1, "c": 1},
        warmup=0,
        block_warmup=1,
    )
    assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 3, "c": 3}
    # Each block: one untimed call, then its timed calls; each round starts one variant later.
    assert "".join(order) == "aaabbcc" + "bbccaaa" + "ccaaabb"


def test_host_us_per_call_reflects_the_cost_of_a_call() -> None:
    slow = common.host_us_per_call(lambda: time.sleep(0.001), calls=5, repeats=2, device=torch.device("cpu"))
    fast = common.host_us_per_call(lambda: None, calls=5, repeats=2, device=torch.device("cpu"))
    assert len(slow) == 2
    assert min(slow) >= 900
    assert max(fast) < min(slow)


def test_budget_scales_repetitions_within_bounds() -> None:
    assert common.Budget.reps_for(10.0, 1.0, floor=2, ceiling=50) == 10
    assert common.Budget.reps_for(0.5, 1.0, floor=2, ceiling=50) == 2
    assert common.Budget.reps_for(1000.0, 1.0, floor=2, ceiling=50) == 50
    budget = common.Budget(100.0)
    assert 0 < budget.left <= 100.0
    assert budget.share(4) == pytest.approx(budget.left / 4, rel=1e-3)
    with pytest.raises(ValueError, match="positive"):
        common.Budget(0)


def test_targets_are_met_missed_or_not_applicable() -> None:
    assert common.target("t", 0.5, 1.0)["met"] is True
    assert common.target("t", 1.5, 1.0)["met"] is False
    assert common.target("t", None, 1.0)["met"] is None
    # A CPU stand-in neither meets nor misses a GPU target, even with a value.
    assert common.target("t", 0.5, 1.0, applies=False)["met"] is None


def test_format_table_aligns_numbers_right_and_text_left() -> None:
    text = common.format_table(("name", "ms"), [("bare", 0.5), ("runner", 12.25), ("none", None)])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "ms"]
    assert lines[2] == "bare    0.5000"
    assert lines[3] == "runner  12.250"
    assert lines[4].endswith("-")
    with pytest.raises(ValueError, match="cells"):
        common.format_table(("a", "b"), [(1,)])


def test_write_results_records_machine_config_and_targets(tmp_path) -> None:
    path = tmp_path / "deep" / "result.json"
    common.write_results(
        path,
        benchmark="demo",
        command="python3 bench/demo.py",
        device=torch.device("cpu"),
        config={"sizes": [1, 2]},
        results=[{"x": 1}],
        targets=[common.target("t", 0.5, 1.0)],
        notes=["a note"],
    )
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == "demo"
    assert payload["machine"]["torch"] == torch.__version__
    assert payload["machine"]["device"] == "cpu"
    assert payload["machine"]["date_utc"].endswith("Z")
    assert payload["machine"]["git_commit"]
    assert payload["config"] == {"sizes": [1, 2]}
    assert payload["targets"][0]["met"] is True
    assert payload["notes"] == ["a note"]


def test_resolve_device_refuses_cuda_without_one() -> None:
    assert common.resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert common.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(SystemExit, match="no CUDA"):
        common.resolve_device("cuda")


def test_graph_tree_watch_sees_inductor_skips_and_restores_capture_begin() -> None:
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    original = torch.cuda.CUDAGraph.capture_begin
    with watch_graph_trees() as watch:
        assert torch.cuda.CUDAGraph.capture_begin is not original
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    assert torch.cuda.CUDAGraph.capture_begin is original
    assert watch.skips == 2
    assert watch.reasons == ["skipping cudagraphs due to mutated inputs (1 instances)"]
    assert watch.captures == 0
    # The watch is over: a later skip is neither counted nor collected.
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to something else")
    assert watch.skips == 2
    assert watch.reasons == ["skipping cudagraphs due to mutated inputs (1 instances)"]
    assert not any(
        type(h).__name__ == "_ReasonHandler"
        for h in logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").handlers
    )


def test_graph_tree_watch_counts_only_captures_begun_from_cudagraph_trees() -> None:
    """A capture counts when inductor's cudagraph_trees.py is on the caller's stack, not otherwise."""
    not_a_graph = object()
    from_trees = compile(
        "torch.cuda.CUDAGraph.capture_begin(graph)", "/site/torch/_inductor/cudagraph_trees.py", "exec"
    )
    with watch_graph_trees() as watch:
        # The original capture_begin then refuses the stand-in object: only the counting matters here.
        with pytest.raises((TypeError, RuntimeError, AttributeError)):
            exec(from_trees, {"torch": torch, "graph": not_a_graph})
        with pytest.raises((TypeError, RuntimeError, AttributeError)):
            torch.cuda.CUDAGraph.capture_begin(not_a_graph)
    assert watch.captures == 1


def test_summary_says_by_how_much_a_target_was_missed() -> None:
    from bench.summarize import target_text

    text = target_text(
        [
            common.target("runner / bare", 1.05, 1.02, unit="x"),
            common.target("check %", 0.4, 2.0, unit="%"),
            common.target("cpu stand-in", 3.0, 1.0, applies=False),
        ]
    )
    assert "runner / bare: 1.05x (**MISSED** (limit 1.02x, over by 0.03))" in text
    assert "check %: 0.4% (met, < 2%)" in text
    assert "cpu stand-in: 3 (n/a)" in text


def test_compact_reason_keeps_the_reason_and_its_deepest_frame() -> None:
    from bench.gpu_decode import compact_reason

    # As inductor logged it on the H200 for the reference decoder (stack shortened).
    message = (
        "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n"
        '   File "/work/main/capture_core/model.py", line 554, in forward\n'
        "    hidden = layer(hidden, positions, slot_ids, kv_cache, attn_metadata)\n"
        '  File "/work/main/capture_core/model.py", line 501, in forward\n'
        "    self.attn(q, k, v, posi"
    )
    assert (
        compact_reason(message) == "skipping cudagraphs due to mutated inputs (1 instances) (at model.py:501)"
    )
    assert compact_reason("skipping cudagraphs due to cpu device") == "skipping cudagraphs due to cpu device"
