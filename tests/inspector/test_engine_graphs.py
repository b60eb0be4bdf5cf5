"""Graphs an engine captured itself: its own key kept beside graph-inspector's, and the graphs it
captured only to throw away (vLLM's memory profiling) shown apart and never counted as serving.

Through a real Recorder into a real SQLite file and PostgreSQL, read by the same queries the pages,
``/metrics`` and ``report`` use.
"""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from workers import FULL, PIECEWISE, capture

from capture_core.descriptor import BatchDescriptor
from inspector.gating.baseline import run_figures
from inspector.gating.report import build_report
from inspector.reading.metrics import InspectorCollector
from inspector.reading.queries import Queries
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store

D64 = BatchDescriptor(64, 64, uniform=True)
D128 = BatchDescriptor(128)
VLLM_KEY = "BatchDescriptor(num_tokens=64, num_reqs=64, uniform=True, has_lora=False, num_active_loras=0)"


def _record(url: str) -> int:
    with Recorder(url, label="vLLM") as recorder:
        # vLLM's memory profiling: the two largest sizes captured, measured and thrown away ...
        recorder.on_capture(replace(capture(D128, PIECEWISE), discarded=True, engine_key="profiled 128"))
        recorder.on_capture(replace(capture(D64), discarded=True, engine_key="profiled 64"))
        # ... then the graphs that serve, the same keys again
        recorder.on_capture(replace(capture(D128, PIECEWISE), engine_key="BatchDescriptor(num_tokens=128)"))
        recorder.on_capture(replace(capture(D64), engine_key=VLLM_KEY))
        for _ in range(5):
            recorder.on_replay(FULL, D64, 60)
        assert recorder.flush(timeout=10)
        return recorder.run_id


def test_discarded_graphs_are_listed_marked_and_never_counted_as_serving(db_url: str) -> None:
    run_id = _record(db_url)
    store = open_store(db_url)
    queries = Queries(store.engine)
    listed = queries.graphs(run_id=run_id).items
    assert [(g["mode"], g["descriptor"]["captured_size"], g["discarded"]) for g in listed] == [
        ("piecewise", 128, True), ("full", 64, True), ("piecewise", 128, False), ("full", 64, False)]
    assert [g["engine_key"] for g in listed][-1] == VLLM_KEY
    # the replays belong to the serving graph, never to the one thrown away
    assert [g["traffic"]["replays"] for g in listed] == [0, 0, 0, 5]
    summary = queries.summary(run_id)["graphs"]
    assert (summary["count"], summary["discarded"], summary["by_mode"]) == (2, 2, {"full": 1, "piecewise": 1})
    assert summary["pool_bytes"] == (64 + 128) * 1024
    assert build_report(store, run_id).runs[0].graphs == 2
    with store.engine.connect() as conn:
        from sqlalchemy.orm import Session

        figures = run_figures(Session(bind=conn), run_id, db_url)
    assert {key: (g.captures, g.replays) for key, g in figures.graphs.items()} == {
        ("full", D64.key): (1, 5), ("piecewise", D128.key): (1, 0)}
    registry = CollectorRegistry(auto_describe=True)
    registry.register(InspectorCollector(store))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    graphs = {s.labels["mode"]: s.value for s in families["graph_inspector_graphs"].samples}
    captures = {s.labels["mode"]: s.value for s in families["graph_inspector_captures"].samples
                if s.name.endswith("_total")}
    assert graphs == {"full": 1.0, "piecewise": 1.0} and captures == {"full": 1.0, "piecewise": 1.0}
