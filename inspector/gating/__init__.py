"""Gating: what CI reads and fails on.

``report.py`` (what was recorded and every violation, as text, JSON or JUnit XML),
``baseline.py`` (a run's graph cache as figures, and the baseline file), ``gate.py`` (the
regression gate: a run against a baseline, one verdict per comparison), ``pytest_plugin.py`` (the
``pytest11`` plugin: a violation fails the test it happened in).
"""

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "inspector.gating.report": ("Report", "build_report", "compile_line", "render"),
    "inspector.gating.baseline": ("Figures", "newest_run", "read_baseline", "run_figures", "save_baseline"),
    "inspector.gating.gate": ("Thresholds", "compare"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
