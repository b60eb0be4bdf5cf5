"""A real graph wrapper (eager backend) recording through the recorder into a real SQLite file,
read back by the report and the metrics; and the recorder benchmark's quick run as a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from capture_core.dispatcher import CUDAGraphDispatcher
from capture_core.events import FanOutObserver
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper
from inspector.gating.report import build_report
from inspector.reading.metrics import PREFIX, InspectorCollector
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store

REPO = Path(__file__).resolve().parents[2]


def step(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    return x * scale


def test_wrapper_traffic_lands_in_sqlite_and_reads_back(sqlite_url: str) -> None:
    with Recorder(sqlite_url, label="e2e", flush_interval=0.05) as recorder:
        dispatcher = CUDAGraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8], observer=recorder)
        runtime = GraphRuntime("eager", observer=recorder, progress=False)
        wrapper = CUDAGraphWrapper(step, runtime, CUDAGraphMode.FULL, name="step")
        x, scale = torch.ones(8), torch.tensor(2.0)
        with runtime.capture_phase():
            for mode, descriptor in dispatcher.capture_list():
                if mode is CUDAGraphMode.FULL:
                    with set_forward_context(mode, descriptor):
                        wrapper(x[: descriptor.num_tokens], scale=scale)
        for real in (1, 3, 3, 5, 8, 20):
            mode, descriptor = dispatcher.dispatch(real, uniform_decode=True)
            with set_forward_context(mode, descriptor, num_real_tokens=real):
                wrapper(x[: descriptor.num_tokens], scale=scale)
        mode, descriptor = dispatcher.dispatch(4, uniform_decode=True)
        with set_forward_context(mode, descriptor, num_real_tokens=4):
            wrapper(x[:4], scale=scale.clone())  # a new tensor where the graph baked in the old one
        assert recorder.flush(timeout=10)

    store = open_store(sqlite_url, upgrade=False)
    try:
        report = build_report(store)
        registry = CollectorRegistry()
        registry.register(InspectorCollector(store))
        value = registry.get_sample_value
        assert value(f"{PREFIX}captures_total", {"mode": "full"}) == 4
        assert value(f"{PREFIX}replays_total", {"mode": "full", "captured_size": "4"}) == 3
        assert value(f"{PREFIX}replays_total", {"mode": "full", "captured_size": "8"}) == 2
        assert value(f"{PREFIX}eager_fallbacks_total", {"reason": "above_max_capture_size"}) == 1
        assert value(f"{PREFIX}padding_tokens_total", {"mode": "full"}) == (1 - 1) + 2 * (4 - 3) + (8 - 5) + (
            4 - 4
        )
    finally:
        store.dispose()
    (run,) = report.runs
    assert (run.label, run.backend, run.graphs, run.traffic.replays) == ("e2e", "eager", 4, 6)
    (finding,) = report.findings
    assert (finding.kind, finding.input_name, finding.descriptor) == (
        "address_drift",
        "scale",
        "tokens=4,reqs=4,uniform=1",
    )
    assert finding.expected_address != finding.actual_address
    assert "copy_()" in finding.message and "test_end_to_end.py" in finding.stack


def test_recorder_fans_out_beside_another_observer(sqlite_url: str) -> None:
    seen = []

    class Spy:
        def on_capture(self, event) -> None:
            seen.append(event.descriptor.key)

        def on_replay(self, mode, descriptor, num_real_tokens) -> None:
            pass

        def on_eager(self, reason, num_real_tokens, mode) -> None:
            pass

        def on_violation(self, event) -> None:
            pass

    with Recorder(sqlite_url) as recorder:
        runtime = GraphRuntime("eager", observer=FanOutObserver(Spy(), recorder), progress=False)
        wrapper = CUDAGraphWrapper(step, runtime, CUDAGraphMode.FULL, name="step")
        dispatcher = CUDAGraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [2])
        ((mode, descriptor),) = dispatcher.capture_list()
        with runtime.capture_phase(), set_forward_context(mode, descriptor):
            wrapper(torch.ones(2), scale=torch.tensor(1.0))
    store = open_store(sqlite_url, upgrade=False)
    try:
        assert build_report(store).runs[0].graphs == 1
    finally:
        store.dispose()
    assert seen == ["tokens=2,reqs=2,uniform=1"]


@pytest.mark.cuda
def test_cuda_graphs_are_recorded_with_their_pool_memory(sqlite_url: str) -> None:
    dispatcher = CUDAGraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4, 8])
    with Recorder(sqlite_url, flush_interval=0.05) as recorder:
        runtime = GraphRuntime("cuda", observer=recorder, progress=False)
        wrapper = CUDAGraphWrapper(step, runtime, CUDAGraphMode.FULL, name="step")
        x, scale = torch.ones(8, device="cuda"), torch.tensor(2.0, device="cuda")
        with runtime.capture_phase():
            for mode, descriptor in dispatcher.capture_list():
                with set_forward_context(mode, descriptor):
                    wrapper(x[: descriptor.num_tokens], scale=scale)
        for real in (1, 3, 8):
            mode, descriptor = dispatcher.dispatch(real, uniform_decode=True)
            with set_forward_context(mode, descriptor, num_real_tokens=real):
                out = wrapper(x[: descriptor.num_tokens], scale=scale)
        torch.cuda.synchronize()
        assert torch.equal(out[:8].cpu(), torch.full((8,), 2.0))
    store = open_store(sqlite_url, upgrade=False)
    try:
        report = build_report(store)
        registry = CollectorRegistry()
        registry.register(InspectorCollector(store))
        pool_bytes = registry.get_sample_value(f"{PREFIX}graph_pool_bytes", {"mode": "full"})
    finally:
        store.dispose()
    (run,) = report.runs
    assert report.ok and (run.backend, run.graphs, run.traffic.replays) == ("cuda", 4, 3)
    assert run.device.startswith("cuda:")
    assert pool_bytes is not None and pool_bytes > 0


@pytest.mark.slow
def test_recorder_bench_quick_run_writes_json_and_targets(tmp_path: Path) -> None:
    out = tmp_path / "recorder.json"
    proc = subprocess.run(
        [sys.executable, "bench/recorder_bench.py", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert payload["benchmark"] == "recorder_bench" and payload["config"]["quick"] is True
    assert set(results["hot_path"]) == {"null observer (call floor)", "bare dict bump", "recorder.on_replay",
                                        "recorder.on_replay, rank of a job (step sequence)"}
    assert results["events_per_s"] > 0 and results["flush"]["rows_per_s_median"] > 0
    assert results["violation_storm"]["dropped"] == 0
    assert payload["targets"][0]["name"].startswith("recorder / bare dict bump")
    assert proc.stdout.rstrip().splitlines()[-1].startswith(payload["targets"][-1]["name"][:20])
