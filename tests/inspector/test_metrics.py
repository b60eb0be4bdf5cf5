"""The Prometheus collector: exact values from recorded runs, naming conventions, bounded labels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from workers import FULL, PIECEWISE, capture, drift

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationEvent, ViolationKind
from capture_core.sizes import EagerReason
from inspector.reading.metrics import METRICS, PREFIX, InspectorCollector, metrics_table_markdown
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store
from inspector.storage.writer import record_compile_event
from inspector.watch.watcher import CompileEvent, CompileEventKind

ALLOWED_LABELS = {"mode", "captured_size", "reason", "kind", "state", "path", "mark"}
"""Small fixed sets: path is graph or eager, mark is not_faster or capture_not_repaid."""


def _registry(url: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(InspectorCollector(open_store(url)))
    return registry


def _record_two_runs(url: str) -> None:
    d4, d8 = BatchDescriptor(4, 4, True), BatchDescriptor(8, None)
    for rank in (0, 1):
        with Recorder(url, rank=rank) as recorder:
            recorder.on_capture(capture(d4))
            recorder.on_capture(capture(d8, mode=PIECEWISE))
            for _ in range(30):
                recorder.on_replay(FULL, d4, 3)
            for _ in range(10):
                recorder.on_replay(PIECEWISE, d8, 8)
            for _ in range(10):
                recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 600, PIECEWISE)
            recorder.on_violation(drift(d4, actual=0x1000 + rank))
            recorder.on_violation(drift(d4, actual=0x1000 + rank))
            recorder.on_violation(
                ViolationEvent(
                    ViolationKind.UNEXPECTED_CAPTURE, BatchDescriptor(64, None), PIECEWISE, "m", "late"
                )
            )
            assert recorder.flush(timeout=10)
            run_id = recorder.run_id
        _hear_compile_events(url, run_id)


def _hear_compile_events(url: str, run_id: int) -> None:
    """What graph-inspector watch writes for torch.compile: 3 re-records of one function, 1 skip."""
    rerecord = CompileEvent(CompileEventKind.RERECORD, "static input data pointer changed.", "m", "forward")
    skip = CompileEvent(CompileEventKind.SKIP, "mutated inputs (1 instances)", "m")
    store = open_store(url)
    with store.engine.begin() as conn:
        for event in (rerecord, rerecord, rerecord, skip):
            record_compile_event(conn, run_id, event)
    store.dispose()


def test_scrape_reports_exact_values(db_url: str) -> None:
    _record_two_runs(db_url)
    registry = _registry(db_url)
    value = registry.get_sample_value
    assert value(f"{PREFIX}graphs", {"mode": "full"}) == 2  # latest run of rank 0 and of rank 1
    assert value(f"{PREFIX}graph_pool_bytes", {"mode": "piecewise"}) == 2 * 8 * 1024
    assert value(f"{PREFIX}captures_total", {"mode": "full"}) == 2
    assert value(f"{PREFIX}capture_duration_seconds_count", {"mode": "full"}) == 2
    assert value(f"{PREFIX}capture_duration_seconds_sum", {"mode": "full"}) == pytest.approx(0.02)
    assert value(f"{PREFIX}replays_total", {"mode": "full", "captured_size": "4"}) == 60
    assert value(f"{PREFIX}replays_total", {"mode": "piecewise", "captured_size": "8"}) == 20
    assert value(f"{PREFIX}real_tokens_total", {"mode": "full"}) == 180
    assert value(f"{PREFIX}padding_tokens_total", {"mode": "full"}) == 60
    assert value(f"{PREFIX}padding_tokens_total", {"mode": "piecewise"}) == 0
    assert value(f"{PREFIX}eager_fallbacks_total", {"reason": "above_max_capture_size"}) == 20
    assert value(f"{PREFIX}violations_total", {"kind": "address_drift"}) == 4
    assert value(f"{PREFIX}violations_total", {"kind": "unexpected_capture"}) == 2
    assert value(f"{PREFIX}compile_events_total", {"kind": "compile_rerecord"}) == 6
    assert value(f"{PREFIX}compile_events_total", {"kind": "compile_skip"}) == 2
    assert value(f"{PREFIX}replay_hit_ratio") == pytest.approx(80 / 100)
    assert value(f"{PREFIX}padding_waste_ratio") == pytest.approx(60 / (180 + 60 + 160))
    assert value(f"{PREFIX}runs", {"state": "ended"}) == 2
    assert value(f"{PREFIX}runs", {"state": "live"}) == 0
    for kind in ("replay", "eager_batch", "violation", "capture"):
        assert value(f"{PREFIX}recorder_dropped_events_total", {"kind": kind}) == 0
    assert value(f"{PREFIX}recorder_dropped_real_tokens_total") == 0
    assert value(f"{PREFIX}database_up") == 1


def test_a_second_run_of_a_rank_replaces_its_graphs_in_the_gauges(sqlite_url: str) -> None:
    _record_two_runs(sqlite_url)
    with Recorder(sqlite_url, rank=0) as recorder:
        recorder.on_capture(capture(BatchDescriptor(2, 2, True)))
    value = _registry(sqlite_url).get_sample_value
    assert value(f"{PREFIX}graphs", {"mode": "full"}) == 2  # rank 0 now holds one graph, rank 1 still one
    assert value(f"{PREFIX}graphs", {"mode": "piecewise"}) == 1
    assert value(f"{PREFIX}captures_total", {"mode": "full"}) == 3


def test_live_run_is_counted_as_live(sqlite_url: str) -> None:
    with Recorder(sqlite_url) as recorder:
        assert recorder.flush(timeout=10)
        assert _registry(sqlite_url).get_sample_value(f"{PREFIX}runs", {"state": "live"}) == 1


def test_every_listed_metric_is_exported_with_conventional_names(sqlite_url: str) -> None:
    _record_two_runs(sqlite_url)
    exposition = generate_latest(_registry(sqlite_url)).decode()
    families = {family.name: family for family in text_string_to_metric_families(exposition)}
    for spec in METRICS:
        assert spec.name.startswith(PREFIX)
        assert re.fullmatch(r"[a-z_]+", spec.name)
        assert set(spec.labels) <= ALLOWED_LABELS, f"{spec.name} has an unbounded label"
        base = spec.name.removesuffix("_total")
        assert base in families, f"{spec.name} missing from the exposition"
        assert families[base].type == spec.type
        assert (spec.type == "counter") == spec.name.endswith("_total")
        for sample in families[base].samples:
            assert "address" not in " ".join(sample.labels), sample
    ratio_names = [s.name for s in METRICS if s.name.endswith("_ratio")]
    for name in ratio_names:
        assert 0 <= (_registry(sqlite_url).get_sample_value(name) or 0) <= 1


def test_unreadable_database_scrapes_as_down_instead_of_failing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    store = open_store(url)
    registry = CollectorRegistry()
    registry.register(InspectorCollector(store))
    assert registry.get_sample_value(f"{PREFIX}database_up") == 1
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE violations")
    assert registry.get_sample_value(f"{PREFIX}database_up") == 0
    assert registry.get_sample_value(f"{PREFIX}violations_total", {"kind": "address_drift"}) is None


def test_a_bug_in_a_read_fails_the_scrape_instead_of_reading_as_an_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = CollectorRegistry()
    registry.register(InspectorCollector(open_store(f"sqlite:///{tmp_path / 'fine.db'}")))
    assert registry.get_sample_value(f"{PREFIX}database_up") == 1

    def typo(*_: object) -> None:
        raise NameError("name 'Runn' is not defined")

    monkeypatch.setattr(InspectorCollector, "_read", typo)
    with pytest.raises(NameError, match="Runn"):
        registry.get_sample_value(f"{PREFIX}database_up")


def test_markdown_table_lists_every_metric() -> None:
    table = metrics_table_markdown()
    assert all(f"`{spec.name}`" in table for spec in METRICS)
    assert table.count("\n") == len(METRICS) + 2


def test_the_inspector_readme_lists_the_metrics_as_exported() -> None:
    readme = (Path(__file__).resolve().parents[2] / "inspector" / "README.md").read_text()
    assert metrics_table_markdown() in readme
