"""Reading: every question asked of the database, answered the same way for every reader.

``queries.py`` (``Queries``: the overview and the findings, built of ``run_queries.py``,
``graph_queries.py`` and ``job_queries.py``; ``fields.py`` how a row reads, ``listing.py`` the
``Page`` of a listing), ``traffic.py`` (``TrafficTotals``: the one formula for hit ratio and padding
waste), ``rollup.py`` (in-memory time series of the append-only tables), ``metrics.py``
(``InspectorCollector``, the Prometheus collector).
"""

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "inspector.reading.queries": ("COMPILE_KINDS", "Queries"),
    "inspector.reading.graph_queries": ("GRAPH_SORTS",),
    "inspector.reading.listing": ("Page",),
    "inspector.reading.traffic": (
        "TrafficTotals", "eager_totals", "integer_sum", "replay_totals", "run_traffic", "traffic_per_run",
    ),
    "inspector.reading.rollup": ("Rollup",),
    "inspector.reading.metrics": ("InspectorCollector",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
