"""Step times recorded and read back: the runtime's timed steps through a real Recorder into the
database, and what each graph is worth on the graphs list, a graph's answer, ``/metrics`` and
``report``; the marks both ways, fed as an engine integration feeds ``on_step_time``."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from workers import FULL, capture, fetch_rows

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.step_time import CUDA_EVENTS, HOST_CLOCK
from inspector.gating.report import build_report, render_json, render_text
from inspector.reading.metrics import PREFIX, InspectorCollector
from inspector.reading.queries import Queries
from inspector.recording.recorder import Recorder
from inspector.storage.models import StepTime
from inspector.storage.store import open_store

FAST, SLOW, UNREPAID = BatchDescriptor(8, 8, True), BatchDescriptor(16, 16, True), BatchDescriptor(4, 4, True)


def graphs_by_size(url: str) -> dict[int, dict]:
    store = open_store(url, upgrade=False)
    try:
        return {g["descriptor"]["captured_size"]: g for g in Queries(store.engine).graphs(per_page=100).items}
    finally:
        store.dispose()


def test_a_runner_with_the_canary_records_each_graphs_host_clock_times(db_url: str) -> None:
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=32)
    with Recorder(db_url, flush_interval=0.05) as recorder:
        runtime = GraphRuntime("eager", observer=recorder, progress=False, canary=True,
                               sampling=Sampling(first=2, every=0))
        runner = DecodeRunner(ReferenceDecoder(config, seed=0), runtime, [2, 4], mode=FULL)
        runner.capture()
        for size in (1, 2, 3, 4, 4, 4, 6):  # 6 is above the largest size: an eager fallback
            ids = torch.arange(size)
            runner.step(ids, ids, ids)
        assert recorder.flush(timeout=10)
    graphs = graphs_by_size(db_url)
    for size, replays in ((2, 2), (4, 4)):
        timed = graphs[size]["step_time"]
        assert graphs[size]["traffic"]["replays"] == replays
        assert (timed["clock"], timed["graph_samples"], timed["eager_samples"], timed["eager_from"]) == (
            HOST_CLOCK, 2, 2, "canary")
        assert timed["graph_seconds"] > 0 and timed["eager_seconds"] > 0 and timed["speedup"] > 0
        assert timed["marks"] == []  # the eager backend: no graph, so nothing is claimed of one
    rows = fetch_rows(db_url, select(StepTime.mode, StepTime.captured_size, StepTime.graph_samples,
                                     StepTime.eager_samples).order_by(StepTime.mode, StepTime.captured_size))
    assert rows == [("full", 2, 2, 2), ("full", 4, 2, 2), ("none", 6, 0, 1)]


def engine_run(url: str) -> int:
    """Three real-backend graphs and their step times, as an engine integration reports them: one
    that pays (x4, many replays), one slower than eager, one whose saving is below its capture time."""
    with Recorder(url, flush_interval=0.05) as recorder:
        for descriptor in (FAST, SLOW, UNREPAID):
            recorder.on_capture(dataclasses.replace(capture(descriptor), backend="cuda", capture_seconds=0.5))
        for _ in range(1000):
            recorder.on_replay(FULL, FAST, 8)
            recorder.on_replay(FULL, SLOW, 16)
        for _ in range(10):
            recorder.on_replay(FULL, UNREPAID, 4)
        recorder.on_step_time(FULL, FAST, 0.001, 0.004, samples=3)
        assert recorder.flush(timeout=10)  # the running totals grow across windows
        recorder.on_step_time(FULL, FAST, 0.001, None, samples=1)
        recorder.on_step_time(FULL, SLOW, 0.002, 0.0015, samples=2, clock=CUDA_EVENTS)
        recorder.on_step_time(FULL, UNREPAID, 0.001, None)
        # No canary step for size 4: the eager fallbacks of 4 real tokens give its eager time.
        recorder.on_step_time(CUDAGraphMode.NONE, BatchDescriptor(4), None, 0.002, samples=4)
        assert recorder.flush(timeout=10)
        assert recorder.run_id is not None
        return recorder.run_id


def test_marks_say_which_graphs_are_not_worth_their_keep_and_every_reader_agrees(db_url: str) -> None:
    run_id = engine_run(db_url)
    graphs = graphs_by_size(db_url)
    fast, slow, unrepaid = (graphs[d.num_tokens]["step_time"] for d in (FAST, SLOW, UNREPAID))
    assert (fast["graph_samples"], fast["eager_samples"], fast["eager_from"]) == (4, 3, "canary")
    assert fast["speedup"] == pytest.approx(4.0) and fast["saved_seconds"] == pytest.approx(3.0)
    assert fast["marks"] == []
    assert slow["speedup"] == pytest.approx(0.75) and slow["saved_seconds"] == pytest.approx(-0.5)
    assert [m["mark"] for m in slow["marks"]] == ["not_faster", "capture_not_repaid"]
    assert unrepaid["eager_from"] == "eager_fallbacks" and unrepaid["speedup"] == pytest.approx(2.0)
    assert unrepaid["saved_seconds"] == pytest.approx(0.01)  # 10 replays x 1 ms saved < 0.5 s capture
    assert [m["mark"] for m in unrepaid["marks"]] == ["capture_not_repaid"]

    store = open_store(db_url, upgrade=False)
    try:
        detail = Queries(store.engine).graph(graphs[16]["id"])
        registry = CollectorRegistry()
        registry.register(InspectorCollector(store))
        report = build_report(store)
    finally:
        store.dispose()
    assert detail is not None and detail["step_time"] == slow
    value = registry.get_sample_value
    steps = f"{PREFIX}step_duration_seconds"
    assert value(f"{steps}_count", {"mode": "full", "captured_size": "8", "path": "graph"}) == 4
    eager_sum = value(f"{steps}_sum", {"mode": "full", "captured_size": "8", "path": "eager"})
    assert eager_sum == pytest.approx(0.012)
    assert value(f"{steps}_count", {"mode": "none", "captured_size": "4", "path": "eager"}) is None
    assert value(f"{PREFIX}graphs_marked", {"mark": "not_faster"}) == 1
    assert value(f"{PREFIX}graphs_marked", {"mark": "capture_not_repaid"}) == 2

    text = render_text(report)
    speedups = "speedup x0.75 (size 16) to x4.00 (size 8)"
    assert f"step time (cuda_events): 3 graph(s) timed against eager, {speedups}" in text
    slow_graph = f"graph {graphs[16]['id']} tokens=16,reqs=16,uniform=1 (full)"
    assert f"advice: {slow_graph}: its replay is not faster" in text
    assert text.count("advice: ") == 3 and "OK: no violations" in text
    (run,) = json.loads(render_json(report))["runs"]
    assert run["id"] == run_id and [t["captured_size"] for t in run["step_times"]] == [4, 8, 16]
    assert report.exit_code == 0  # advice, not a violation


def test_a_clean_run_has_no_marks_and_says_so_nowhere(db_url: str) -> None:
    with Recorder(db_url, flush_interval=0.05) as recorder:
        recorder.on_capture(dataclasses.replace(capture(FAST), backend="cuda", capture_seconds=0.01))
        for _ in range(100):
            recorder.on_replay(FULL, FAST, 8)
        recorder.on_step_time(FULL, FAST, 0.001, 0.003)
        # A graph whose replays were timed but never the same step eagerly (the canary off): no
        # speedup, so nothing is claimed of it.
        recorder.on_capture(dataclasses.replace(capture(SLOW), backend="cuda", capture_seconds=0.01))
        recorder.on_replay(FULL, SLOW, 16)
        recorder.on_step_time(FULL, SLOW, 0.002, None)
    graphs = graphs_by_size(db_url)
    fast, replay_only = graphs[8]["step_time"], graphs[16]["step_time"]
    assert fast["speedup"] == pytest.approx(3.0) and fast["marks"] == []
    assert replay_only["graph_samples"] == 1 and replay_only["eager_samples"] == 0
    assert (replay_only["speedup"], replay_only["saved_seconds"], replay_only["marks"]) == (None, None, [])
    store = open_store(db_url, upgrade=False)
    try:
        text = render_text(build_report(store))
        assert "advice: " not in text
        assert "1 graph(s) timed against eager, speedup x3.00 (size 8) to x3.00 (size 8)" in text
    finally:
        store.dispose()


@pytest.mark.parametrize("bad", [
    {"graph_seconds": -1.0}, {"graph_seconds": math.nan}, {"eager_seconds": math.inf},
    {"samples": 0}, {"samples": True}, {"clock": "sundial"}, {"graph_seconds": None},
], ids=lambda bad: next(iter(bad)) + "=" + repr(next(iter(bad.values()))))
def test_a_step_time_that_is_no_time_is_left_out_and_logged_once(sqlite_url: str, bad, caplog) -> None:
    call = {"graph_seconds": 0.001, "eager_seconds": None, "samples": 1, "clock": CUDA_EVENTS} | bad
    logged = caplog.at_level(logging.WARNING, logger="graph_inspector.recorder")
    with logged, Recorder(sqlite_url) as recorder:
        recorder.on_capture(capture(FAST))
        for _ in range(3):
            recorder.on_step_time(FULL, FAST, **call)
        recorder.on_step_time(FULL, FAST, 0.002, None)
    assert sum("a step time that is no time" in r.message for r in caplog.records) == 1
    (graph,) = graphs_by_size(sqlite_url).values()
    assert graph["step_time"]["graph_samples"] == 1 and graph["step_time"]["graph_seconds"] == 0.002
