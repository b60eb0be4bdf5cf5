"""Prometheus metrics, read from the database at scrape time by a custom collector.

The state lives in the database (several recording processes write it; the daemon only reads), so
the collector yields fresh metric families on every scrape instead of keeping counters of its own.
Each scrape is a handful of aggregate queries over small tables: graphs, violations (one row per
distinct finding), runs, and the running totals the recorder keeps per graph key and per eager
reason. It never scans the replay windows, so its cost does not grow with the length of a run.

Counters are sums over every run in the database (they only grow while runs are recorded). The
cache gauges (graphs, pool bytes) describe the current state: the latest run of each host and rank.
Labels are small fixed sets (mode, captured size, reason, kind, state), never an address.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Connection, and_, func, select
from sqlalchemy.orm import Session

from capture_core.events import ViolationKind
from inspector.reading.graph_worth import NONE_MODE, graph_worth, marked
from inspector.reading.traffic import TrafficTotals, eager_totals, replay_totals, run_traffic
from inspector.recording.losses import Sidecar, run_losses
from inspector.storage.models import CompileRecord, EagerTotal, Graph, ReplayTotal, Run, StepTime, Violation
from inspector.storage.store import DATABASE_ERRORS, Store

log = logging.getLogger(__name__)

PREFIX = "graph_inspector_"
LIVE_AFTER_S = 60.0
"""A run that has not ended and flushed within this many seconds counts as live; older ones as stale."""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: the README table, the Grafana dashboard and the alert rules use these."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        f"{PREFIX}graphs",
        "gauge",
        ("mode",),
        "Graphs held by the latest run of each host and rank, by runtime mode.",
    ),
    MetricSpec(
        f"{PREFIX}graph_pool_bytes",
        "gauge",
        ("mode",),
        "Graph-pool memory held by those graphs, in bytes, by runtime mode.",
    ),
    MetricSpec(f"{PREFIX}captures_total", "counter", ("mode",), "Graphs captured, over every recorded run."),
    MetricSpec(
        f"{PREFIX}capture_duration_seconds",
        "summary",
        ("mode",),
        "Time spent capturing graphs, warm-up included (the sum in seconds, and the count of captures).",
    ),
    MetricSpec(
        f"{PREFIX}replays_total",
        "counter",
        ("mode", "captured_size"),
        "Graph replays, by runtime mode and captured size (the padded token count).",
    ),
    MetricSpec(
        f"{PREFIX}real_tokens_total",
        "counter",
        ("mode",),
        "Real tokens (num_real_tokens, not padding) computed by graph replays.",
    ),
    MetricSpec(
        f"{PREFIX}padding_tokens_total",
        "counter",
        ("mode",),
        "Padding tokens computed by graph replays: captured size times replays, less the real tokens.",
    ),
    MetricSpec(
        f"{PREFIX}step_duration_seconds",
        "summary",
        ("mode", "captured_size", "path"),
        "Timed steps (sampled replays, path=graph; the same step run eagerly at that size, path=eager), "
        "over every run: the sum in seconds and the count. Eager over graph is the speedup.",
    ),
    MetricSpec(
        f"{PREFIX}graphs_marked",
        "gauge",
        ("mark",),
        "Graphs of the latest run of each host and rank that are not worth their keep, by mark (advice, "
        "not violations): not_faster (replay not faster than eager at its size), capture_not_repaid "
        "(saved less time than its capture took).",
    ),
    MetricSpec(
        f"{PREFIX}eager_fallbacks_total",
        "counter",
        ("reason",),
        "Batches that ran eagerly instead of replaying a graph, by reason.",
    ),
    MetricSpec(
        f"{PREFIX}violations_total",
        "counter",
        ("kind",),
        f"Violations seen (every occurrence), by kind: {', '.join(kind.value for kind in ViolationKind)}.",
    ),
    MetricSpec(
        f"{PREFIX}compile_events_total",
        "counter",
        ("kind",),
        "torch.compile's CUDA-graph skips and re-records heard by graph-inspector watch (every occurrence), "
        "by kind: compile_skip, compile_rerecord.",
    ),
    MetricSpec(
        f"{PREFIX}replay_hit_ratio",
        "gauge",
        (),
        "Share of batches served by a graph replay rather than eagerly (0..1), over every run.",
    ),
    MetricSpec(
        f"{PREFIX}padding_waste_ratio",
        "gauge",
        (),
        "Share of the tokens computed by replays that were padding (0..1), over every run.",
    ),
    MetricSpec(
        f"{PREFIX}runs",
        "gauge",
        ("state",),
        "Recorded runs by state: live (flushed within a minute), stale (not ended, silent), ended.",
    ),
    MetricSpec(
        f"{PREFIX}recorder_dropped_events_total",
        "counter",
        ("kind",),
        "Events recorders could not keep (database unavailable too long, pending set full, corrupt "
        "file), as the engine reported them, by kind: replay, eager_batch, violation (occurrences), "
        "capture (and unclassified: counted by an older version); over every run, those only a sidecar file "
        "holds included.",
    ),
    MetricSpec(
        f"{PREFIX}recorder_dropped_real_tokens_total",
        "counter",
        (),
        "Real tokens (num_real_tokens) of the replays and eager batches recorders could not keep.",
    ),
    MetricSpec(
        f"{PREFIX}database_up",
        "gauge",
        (),
        "1 when the last scrape could read the database, 0 when it could not.",
    ),
    MetricSpec(
        f"{PREFIX}scrape_duration_seconds",
        "gauge",
        (),
        "Time this scrape spent reading the database, in seconds.",
    ),
)
SPECS = {spec.name: spec for spec in METRICS}
DROPPED_KINDS = {"replay": "replays", "eager_batch": "eager_batches", "violation": "violations",
                 "capture": "captures"}
"""The ``kind`` label of the dropped-events counter -> the ``Losses`` field it counts."""


def _family(name: str) -> Metric:
    spec = SPECS[name]
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.type == "summary":
        return SummaryMetricFamily(spec.name, spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


class InspectorCollector(Collector):
    """Yields every metric in ``METRICS`` from the database, fresh at each scrape.

    Register it with a ``CollectorRegistry`` (the daemon's, or your own in-process). A scrape that
    cannot read the database yields ``graph_inspector_database_up 0`` instead of failing; any other
    error (a bug in a read) fails the scrape, so that it cannot pass for an outage.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.sidecar = Sidecar(store.sqlite_path)

    def describe(self) -> Iterator[Metric]:
        for spec in METRICS:
            yield _family(spec.name)

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        families = {spec.name: _family(spec.name) for spec in METRICS}
        try:
            with self.store.engine.connect() as conn:
                self._read(conn, families, time.time())
            up = 1.0
        except DATABASE_ERRORS as error:  # the scrape answers when the database cannot; a bug raises
            log.warning("graph-inspector metrics: cannot read %s: %s", self.store.display_url, error)
            families = {spec.name: _family(spec.name) for spec in METRICS}
            up = 0.0
        families[f"{PREFIX}database_up"].add_metric([], up)
        families[f"{PREFIX}scrape_duration_seconds"].add_metric([], time.perf_counter() - started)
        yield from families.values()

    def _read(self, conn: Connection, families: dict[str, Metric], now: float) -> None:
        f = families
        latest = select(func.max(Run.id)).group_by(Run.host, Run.rank).scalar_subquery()
        for mode, count, pool in conn.execute(
            select(Graph.mode, func.count(), func.coalesce(func.sum(Graph.pool_bytes), 0))
            .where(Graph.run_id.in_(latest), Graph.discarded.is_(False))
            .group_by(Graph.mode)
        ):
            f[f"{PREFIX}graphs"].add_metric([mode], count)
            f[f"{PREFIX}graph_pool_bytes"].add_metric([mode], pool)

        for mode, count, seconds in conn.execute(
            select(Graph.mode, func.count(), func.coalesce(func.sum(Graph.capture_seconds), 0.0))
            .where(Graph.discarded.is_(False))
            .group_by(Graph.mode)
        ):
            f[f"{PREFIX}captures_total"].add_metric([mode], count)
            f[f"{PREFIX}capture_duration_seconds"].add_metric([mode], count_value=count, sum_value=seconds)

        by_size = replay_totals(conn, ReplayTotal.mode, ReplayTotal.captured_size)
        by_mode: dict[str, TrafficTotals] = defaultdict(TrafficTotals)
        for (mode, size), traffic in sorted(by_size.items()):
            f[f"{PREFIX}replays_total"].add_metric([mode, str(size)], traffic.replays)
            by_mode[mode].add(traffic)
        for mode, traffic in by_mode.items():
            f[f"{PREFIX}real_tokens_total"].add_metric([mode], traffic.num_real_tokens)
            f[f"{PREFIX}padding_tokens_total"].add_metric([mode], traffic.padding_tokens)
        self._read_step_times(conn, f, latest)
        for (reason,), (batches, _) in sorted(eager_totals(conn, EagerTotal.reason).items()):
            f[f"{PREFIX}eager_fallbacks_total"].add_metric([reason], batches)

        for kind, count in conn.execute(
            select(Violation.kind, func.sum(Violation.count))
            .group_by(Violation.kind)
            .order_by(Violation.kind)
        ):
            f[f"{PREFIX}violations_total"].add_metric([kind], int(count))

        for kind, count in conn.execute(
            select(CompileRecord.kind, func.sum(CompileRecord.count))
            .group_by(CompileRecord.kind)
            .order_by(CompileRecord.kind)
        ):
            f[f"{PREFIX}compile_events_total"].add_metric([kind], int(count))

        overall = run_traffic(conn)
        if overall.hit_ratio is not None:
            f[f"{PREFIX}replay_hit_ratio"].add_metric([], overall.hit_ratio)
        if overall.padding_waste is not None:
            f[f"{PREFIX}padding_waste_ratio"].add_metric([], overall.padding_waste)

        live_since = now - LIVE_AFTER_S
        states = {"live": 0, "stale": 0, "ended": 0}
        open_runs = Run.ended_at.is_(None)
        states["ended"] = conn.execute(select(func.count()).where(Run.ended_at.is_not(None))).scalar_one()
        states["live"] = conn.execute(
            select(func.count()).where(and_(open_runs, Run.last_seen_at >= live_since))
        ).scalar_one()
        states["stale"] = conn.execute(
            select(func.count()).where(and_(open_runs, Run.last_seen_at < live_since))
        ).scalar_one()
        for state, count in states.items():
            f[f"{PREFIX}runs"].add_metric([state], count)
        dropped = run_losses(conn, self.sidecar).total()
        for kind, count in DROPPED_KINDS.items():
            f[f"{PREFIX}recorder_dropped_events_total"].add_metric([kind], getattr(dropped, count))
        if dropped.unclassified:  # runs recorded by an older version, which counted rows
            f[f"{PREFIX}recorder_dropped_events_total"].add_metric(["unclassified"], dropped.unclassified)
        f[f"{PREFIX}recorder_dropped_real_tokens_total"].add_metric([], dropped.real_tokens)


    @staticmethod
    def _read_step_times(conn: Connection, f: dict[str, Metric], latest: Any) -> None:
        """The step-time summary of every graph key (not the eager fallbacks, whose sizes are any
        token count: an unbounded label), and the marked graphs of the latest runs."""
        t = StepTime
        for mode, size, graph_s, graph_n, eager_s, eager_n in conn.execute(
            select(t.mode, t.captured_size, func.sum(t.graph_seconds), func.sum(t.graph_samples),
                   func.sum(t.eager_seconds), func.sum(t.eager_samples))
            .where(t.mode != NONE_MODE)
            .group_by(t.mode, t.captured_size)
            .order_by(t.mode, t.captured_size)
        ):
            for path, seconds, samples in (("graph", graph_s, graph_n), ("eager", eager_s, eager_n)):
                if samples:
                    f[f"{PREFIX}step_duration_seconds"].add_metric(
                        [mode, str(size), path], count_value=int(samples), sum_value=float(seconds))
        with Session(bind=conn) as session:
            graphs = session.scalars(select(Graph).where(Graph.run_id.in_(latest))).all()
            traffic = replay_totals(session, ReplayTotal.graph_id, graph_ids=[g.id for g in graphs])
            replays = {graph_id: totals.replays for (graph_id,), totals in traffic.items()}
            counts = marked(graph_worth(session, graphs, replays).values())
        for mark, count in counts.items():
            f[f"{PREFIX}graphs_marked"].add_metric([mark], count)


def metrics_table_markdown() -> str:
    """The README's metrics table, generated from ``METRICS`` so the two never disagree."""
    lines = ["| Metric | Type | Labels | Meaning |", "| --- | --- | --- | --- |"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        lines.append(f"| `{spec.name}` | {spec.type} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"
