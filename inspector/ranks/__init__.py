"""Ranks: the ranks of one distributed job, checked against each other.

``steps.py`` (the step sequence one rank keeps, one list append per batch), ``check.py``
(``RankCheck``: rank 0's recorder compares the ranks' graphs and steps and records each difference
as a ``rank_divergence``; the job page's rank matrix).
"""

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "inspector.ranks.steps": ("StepLog", "StepSegment"),
    "inspector.ranks.check": ("RankCheck", "captured_graphs", "job_runs", "rank_matrix"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
