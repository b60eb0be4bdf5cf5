"""The pool forecast: what a list of capture sizes needs in one shared pool, captured largest first,
from the pool bytes runs recorded; the memory budget it bounds and vLLM's line it gives."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_advice_recorded import cli
from workers import FULL, PIECEWISE, capture

from capture_core.descriptor import BatchDescriptor
from inspector.advice.memory import MIB, PoolForecast, RecordedPool, vllm_gpu_memory_utilization
from inspector.recording.recorder import Recorder


def run(run_id: int, base: float, extras: dict[int, float], largest: int) -> list[RecordedPool]:
    """One run's record in capture order: the largest graph first, then the smaller ones."""
    graphs = [RecordedPool(run_id, largest, round(base * MIB))]
    graphs += [RecordedPool(run_id, size, round(extra * MIB)) for size, extra in sorted(extras.items(),
                                                                                          reverse=True)]
    return graphs


def test_the_largest_graph_reserves_activations_and_each_smaller_one_adds_its_extra() -> None:
    # Extras grow with the size (outputs: 1 MiB + 1/32 MiB a token); the largest, 256, reserved 300 MiB.
    extras = {size: 1 + size / 32 for size in (8, 16, 32, 64, 128)}
    forecast = PoolForecast.fit(run(1, 300, extras, 256))
    assert forecast is not None
    assert forecast.extra(32) == pytest.approx(2 * MIB)
    assert forecast.extra(48) == pytest.approx((1 + 48 / 32) * MIB), "between sizes: interpolated"
    assert forecast.extra(256) == pytest.approx((1 + 256 / 32) * MIB), "beyond them: the line through them"
    assert forecast.activations_per_token == pytest.approx((300 - 9) * MIB / 256)
    assert forecast.base(256) == pytest.approx(300 * MIB)
    assert forecast.base(128) == pytest.approx(5 * MIB + 291 * MIB / 2)
    # The recorded list comes out as it was recorded; a subset: its largest's base and the extras.
    assert forecast.pool_bytes([8, 16, 32, 64, 128, 256]) == pytest.approx((300 + sum(extras.values())) * MIB)
    assert forecast.pool_bytes([4, 100]) == pytest.approx(forecast.base(100) + forecast.extra(4))
    assert forecast.pool_bytes([]) == 0.0
    assert "captured largest first" in forecast.describe()


def test_one_size_s_segment_jump_is_passed_over_and_extras_that_grow_come_through() -> None:
    # As on the H200 (small reference decoder, 35 sizes): 0-2 MiB per size, and 192 MiB at one size,
    # where the allocator reserved a new segment that the captures after it filled.
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    extras = {size: 0.0 for size in sizes}
    extras[24], extras[48] = 192.0, 2.0
    forecast = PoolForecast.fit(run(1, 600, extras, 128))
    assert forecast is not None
    assert forecast.extra(24) == 0.0 and forecast.extra(20) == 0.0
    assert forecast.pool_bytes([2, 24, 64, 128]) == pytest.approx(600 * MIB)
    growing = {size: 1 + size / 8 for size in sizes} | {24: 150.0}  # a jump on extras that grow
    forecast = PoolForecast.fit(run(1, 600, growing, 128))
    assert forecast is not None
    assert (1 + 16 / 8) * MIB <= forecast.extra(24) <= (1 + 32 / 8) * MIB  # among its neighbours', not 150
    assert forecast.extra(48) == pytest.approx((1 + 48 / 8) * MIB)
    assert forecast.extra(1) == pytest.approx((1 + 1 / 8) * MIB)  # the ends keep their own


def test_runs_pool_their_records_and_a_run_without_a_pool_forecasts_nothing() -> None:
    one = run(1, 300, {8: 2, 64: 4}, 256)
    other = run(2, 160, {8: 4, 64: 6}, 128)
    forecast = PoolForecast.fit(one + other)
    assert forecast is not None and forecast.extras == ((8, 3 * MIB), (64, 5 * MIB))  # medians
    assert [size for size, _ in forecast.recorded_bases] == [128, 256]
    assert PoolForecast.fit([RecordedPool(1, 8, 0), RecordedPool(1, 4, 0)]) is None  # the eager backend
    assert PoolForecast.fit([]) is None


def test_vllm_keeps_its_kv_cache_when_its_share_moves_by_the_pool_s_change() -> None:
    gpu = 141 * 2**30
    assert vllm_gpu_memory_utilization(0.9, 800 * MIB, 300 * MIB, gpu) == pytest.approx(0.9 - 500 * MIB / gpu)


def test_a_memory_budget_bounds_the_advice_by_what_its_sizes_need_and_vllm_s_line_says_so(db_url) -> None:
    with Recorder(db_url, label="pool") as recorder:
        for size, pool in ((64, 200), (32, 3), (16, 2), (8, 2)):  # captured largest first
            event = capture(BatchDescriptor(size, size, True))
            recorder.on_capture(dataclasses.replace(event, backend="cuda", pool_bytes=pool * MIB))
        for real in range(1, 65):
            for _ in range(real % 7 + 1):
                recorder.on_replay(FULL, BatchDescriptor(64, 64, True), real)
        recorder.on_capture(dataclasses.replace(capture(BatchDescriptor(64), mode=PIECEWISE), backend="cuda",
                                                pool_bytes=0))
    free = json.loads(cli("--db", db_url, "--max-graphs", "8", "--format", "json").stdout)
    assert free["graphs"] == 8
    budget = 200 + 2 + 2 + 3 + 0.5  # the largest and three smaller sizes, as recorded
    vllm = ("--gpu-memory-utilization", "0.9", "--gpu-memory-gib", "141")
    bound = json.loads(cli("--db", db_url, "--max-graphs", "8", "--memory-budget", str(budget), *vllm,
                           "--format", "json").stdout)
    assert bound["graphs"] < 8 and bound["bounded_by"].startswith("the memory budget")
    memory = bound["memory"]
    assert memory["advised_pool_bytes"] <= budget * MIB < memory["current_pool_bytes"] + 8 * MIB
    expected = 0.9 + (memory["advised_pool_bytes"] - memory["current_pool_bytes"]) / (141 * 2**30)
    assert memory["vllm_gpu_memory_utilization"] == pytest.approx(expected)
    assert f"--gpu-memory-utilization {expected:.4f}" in memory["vllm"]
    text = cli("--db", db_url, "--max-graphs", "8", "--memory-budget", str(budget)).stdout
    assert "memory           the graph pool goes" in text and "--gpu-memory-gib for the figure" in text
