"""Imports go ``dashboard -> inspector -> capture_core``, never back, the cache does not lean on
its reference workload, and inside the inspector recording and storage never lean on reading or
gating: every file of every layer read for its imports, every module of it imported for what it
pulls in, and each check shown to fail on an import planted against it."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tests.support.layers import (
    forbidden_loaded,
    import_cycles,
    loaded_modules,
    module_files,
    outside,
    static_violations,
)

REPO = Path(__file__).resolve().parents[1]
UPPER_LAYERS = ("inspector", "dashboard")
DATABASE_AND_WEB = ("sqlalchemy", "alembic", "flask", "werkzeug", "jinja2", "prometheus_client", "waitress")
WEB = ("dashboard", "flask", "werkzeug", "jinja2", "waitress")
REFERENCE = "capture_core.reference"
"""The reference workload: it may use the cache; the cache (the rest of capture_core) never uses it."""
WRITE_STAGES = ("inspector/recording", "inspector/storage")
READ_STAGES = ("inspector.reading", "inspector.gating")
"""What the engine's process runs (recording, storage) never needs the daemon's and CI's side."""


def _write_stage_violations(root: Path) -> list[str]:
    return [found for stage in WRITE_STAGES for found in static_violations(root, stage, READ_STAGES)]


def _write_stage_modules(root: Path) -> list[str]:
    return [name for stage in WRITE_STAGES for name, _ in module_files(root, stage)]


def _cache_modules(root: Path) -> list[str]:
    return [name for name, _ in module_files(root, "capture_core", exclude=[REFERENCE])]


def test_capture_core_imports_only_torch_and_the_standard_library() -> None:
    assert outside(REPO, "capture_core", allowed=["torch"]) == []


def test_capture_core_imports_nothing_of_the_inspector_the_dashboard_or_their_libraries() -> None:
    assert static_violations(REPO, "capture_core", [*UPPER_LAYERS, *DATABASE_AND_WEB]) == []


def test_the_cache_modules_import_nothing_of_the_reference_workload() -> None:
    assert static_violations(REPO, "capture_core", [REFERENCE], exclude=[REFERENCE]) == []


def test_the_inspector_imports_nothing_of_the_dashboard_or_flask() -> None:
    assert static_violations(REPO, "inspector", WEB) == []


def test_no_modules_of_the_inspector_import_each_other_in_a_circle() -> None:
    assert import_cycles(REPO, "inspector") == []


def test_recording_and_storage_import_nothing_of_reading_or_gating() -> None:
    assert _write_stage_modules(REPO)  # the stages are there to be read
    assert _write_stage_violations(REPO) == []


@pytest.mark.slow
def test_at_run_time_each_layer_loads_only_what_it_may() -> None:
    every_capture_core = [name for name, _ in module_files(REPO, "capture_core")]
    capture_core = loaded_modules(REPO, every_capture_core)
    assert forbidden_loaded(capture_core, [*UPPER_LAYERS, *DATABASE_AND_WEB]) == []
    assert forbidden_loaded(loaded_modules(REPO, _cache_modules(REPO)), [REFERENCE]) == []
    inspector = loaded_modules(REPO, [name for name, _ in module_files(REPO, "inspector")])
    assert forbidden_loaded(inspector, WEB) == []
    assert "capture_core" in inspector and "sqlalchemy" in inspector  # it did import the layer
    write_stages = loaded_modules(REPO, _write_stage_modules(REPO))
    assert forbidden_loaded(write_stages, READ_STAGES) == []
    assert "inspector.storage.writer" in write_stages and "inspector.recording.recorder" in write_stages


# --- each check fails on a planted import ----------------------------------------------------


def _copy(package: str, tmp_path: Path) -> Path:
    shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    return tmp_path


def _plant(root: Path, relative: str, source: str) -> None:
    (root / relative).write_text(textwrap.dedent(source))


def test_a_planted_lazy_import_of_the_inspector_in_capture_core_is_found(tmp_path: Path) -> None:
    root = _copy("capture_core", tmp_path)
    _plant(root, "capture_core/planted.py", """\
        def late():
            from inspector.recording.recorder import Recorder  # inside a function: imported only when called
            return Recorder
        """)
    _plant(root, "capture_core/ubatch/planted.py", "from ...inspector import queries\n")
    assert static_violations(root, "capture_core", UPPER_LAYERS) == [
        "capture_core/planted.py:2 imports inspector.recording.recorder",
        "capture_core/planted.py:2 imports inspector.recording.recorder.Recorder",
        "capture_core/ubatch/planted.py:1 imports inspector",
        "capture_core/ubatch/planted.py:1 imports inspector.queries",
    ]


def test_a_planted_third_party_import_in_capture_core_is_found(tmp_path: Path) -> None:
    root = _copy("capture_core", tmp_path)
    _plant(root, "capture_core/planted.py", "import importlib\nnp = importlib.import_module('numpy')\n")
    assert outside(root, "capture_core", allowed=["torch"]) == ["capture_core/planted.py:2 imports numpy"]


def test_a_planted_reference_import_in_a_cache_module_is_found(tmp_path: Path) -> None:
    root = _copy("capture_core", tmp_path)
    _plant(root, "capture_core/planted.py", "from capture_core.reference import ModelConfig\n")
    assert static_violations(root, "capture_core", [REFERENCE], exclude=[REFERENCE]) == [
        "capture_core/planted.py:1 imports capture_core.reference",
        "capture_core/planted.py:1 imports capture_core.reference.ModelConfig",
    ]
    assert REFERENCE in forbidden_loaded(loaded_modules(root, ["capture_core.planted"]), [REFERENCE])


def test_a_planted_flask_import_in_the_inspector_is_found_statically_and_at_run_time(tmp_path: Path) -> None:
    root = _copy("inspector", tmp_path)
    _plant(root, "inspector/planted.py", """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from dashboard.app import create_app
        import flask
        """)
    assert static_violations(root, "inspector", WEB) == [
        "inspector/planted.py:4 imports dashboard.app",
        "inspector/planted.py:4 imports dashboard.app.create_app",
        "inspector/planted.py:5 imports flask",
    ]
    assert "flask" in forbidden_loaded(loaded_modules(root, ["inspector.planted"]), WEB)


def test_a_planted_import_of_reading_in_storage_is_found_statically_and_at_run_time(tmp_path: Path) -> None:
    root = _copy("inspector", tmp_path)
    _copy("capture_core", tmp_path)  # the inspector imports the checkout's cache, not an installed one
    _plant(root, "inspector/storage/planted.py", """\
        def late():
            from inspector.reading.traffic import TrafficTotals  # imported only when called
            return TrafficTotals
        from inspector.gating import report
        """)
    assert _write_stage_violations(root) == [
        "inspector/storage/planted.py:2 imports inspector.reading.traffic",
        "inspector/storage/planted.py:2 imports inspector.reading.traffic.TrafficTotals",
        "inspector/storage/planted.py:4 imports inspector.gating",
        "inspector/storage/planted.py:4 imports inspector.gating.report",
    ]
    assert "inspector.gating.report" in forbidden_loaded(
        loaded_modules(root, ["inspector.storage.planted"]), READ_STAGES
    )



def test_a_planted_import_circle_in_the_inspector_is_found(tmp_path: Path) -> None:
    root = _copy("inspector", tmp_path)
    _plant(root, "inspector/recording/planted.py", """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:  # for a type only, still a circle
            from inspector.recording.batch import TrafficWindow
        """)
    batch = root / "inspector" / "recording" / "batch.py"
    batch.write_text(batch.read_text() + "\nfrom inspector.recording import planted  # noqa\n")
    assert import_cycles(root, "inspector") == [["inspector.recording.batch", "inspector.recording.planted"]]
