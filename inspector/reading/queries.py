"""The read side of the database: every question the dashboard, its JSON API and the CLI ask.

Answers are plain JSON-ready dictionaries (rows read as ``inspector.reading.fields`` spells them), so that a
page and its JSON twin are built from the same data. Times are UNIX epoch seconds, memory is bytes,
ratios are 0..1 (None when there is nothing to divide). Traffic figures are ``TrafficTotals`` read
from the running-totals tables (``inspector.reading.traffic``, as the Prometheus collector and the CI report
read them, so they agree); traffic over time, the batch-size histogram and the violation counts
come from the in-memory ``Rollup`` (see ``inspector.reading.rollup``); everything else is an indexed query
over small result sets.

``Queries`` is one object that answers all of them, asked by part: the runs
(``inspector.reading.run_queries``), the graphs (``inspector.reading.graph_queries``), the jobs
(``inspector.reading.job_queries``), and here the overview and the findings; listings come a ``Page`` at a
time (``inspector.reading.listing``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, select

from inspector.reading import fields
from inspector.reading.divergences import with_divergences
from inspector.reading.graph_queries import GraphQueries
from inspector.reading.job_queries import JobQueries
from inspector.reading.listing import VIOLATION_ORDER, Page, equal, page_of
from inspector.reading.traffic import (
    eager_totals,
    integer_sum,
    never_captured,
    never_captured_line,
    replay_totals,
    run_traffic,
)
from inspector.storage.models import CompileRecord, EagerTotal, Graph, ReplayTotal, Run, Violation

COMPILE_KINDS = ("compile_skip", "compile_rerecord")
"""What ``graph-inspector watch`` records of torch.compile's cudagraph trees (``compile_events``)."""


class Queries(GraphQueries, JobQueries):
    """Read-only questions over one inspector database. One instance serves all request threads.

    The runs, the graphs and the jobs are asked in ``RunQueries``, ``GraphQueries`` and
    ``JobQueries``; the overview and the findings (violations, torch.compile's events) here.
    """

    # Overview

    def summary(self, run_id: int | None = None) -> dict[str, Any]:
        """The overview: totals and the chart series, for one run or (``None``) every run."""
        self.rollup.refresh()
        scope = None if run_id is None else [run_id]
        with self._session() as session:
            serving = Graph.discarded.is_(False)  # an engine's throw-away graphs are counted apart
            graph_filter = [serving] if run_id is None else [serving, Graph.run_id == run_id]
            by_mode = dict(
                session.execute(
                    select(Graph.mode, func.count(Graph.id)).where(*graph_filter).group_by(Graph.mode)
                ).all()
            )
            totals = session.execute(
                select(func.count(Graph.id), integer_sum(Graph.pool_bytes), func.sum(Graph.capture_seconds),
                       integer_sum(case((Graph.unexpected, 1), else_=0)))
                .where(*graph_filter)
            ).one()
            thrown_away = [Graph.discarded.is_(True), *graph_filter[1:]]
            discarded = session.scalar(select(func.count(Graph.id)).where(*thrown_away)) or 0
            memory = session.execute(
                select(Graph.id, Graph.run_id, Graph.mode, Graph.captured_size, Graph.pool_bytes)
                .where(*graph_filter)
                .order_by(Graph.captured_size, Graph.id)
            ).all()
            run_filter = [] if run_id is None else [Run.id == run_id]
            run_count = session.scalar(select(func.count(Run.id)).where(*run_filter)) or 0
            backends = sorted(session.scalars(select(Run.backend).where(*run_filter).distinct()))
            traffic = run_traffic(session, scope)
            eager = eager_totals(session, EagerTotal.reason, EagerTotal.mode, run_ids=scope)
            by_size = replay_totals(session, ReplayTotal.captured_size, ReplayTotal.mode, run_ids=scope)
            injected_graphs = len(fields.injected_captures(session, run_ids=scope))
            planted = select(Violation.kind, func.count(Violation.id)).where(Violation.injected.is_(True))
            if run_id is not None:
                planted = planted.where(Violation.run_id == run_id)
            injected = dict(session.execute(planted.group_by(Violation.kind)).all())
            waiting = never_captured(session, scope)
            labels = dict(session.execute(select(Run.id, Run.label).where(Run.id.in_(list(waiting)))).all())
            compile_filter = [] if run_id is None else [CompileRecord.run_id == run_id]
            compile_kinds = dict(
                session.execute(
                    select(CompileRecord.kind, integer_sum(CompileRecord.count))
                    .where(*compile_filter)
                    .group_by(CompileRecord.kind)
                    .order_by(CompileRecord.kind.desc())
                ).all()
            )
        kinds = self.rollup.findings(scope)
        return {
            "run": run_id,
            "runs": {"total": run_count, "live": self.live_run_ids(run_id), "backends": backends},
            "graphs": {
                "count": totals[0],
                "by_mode": by_mode,
                "pool_bytes": totals[1] or 0,
                "capture_seconds": totals[2] or 0.0,
                "unexpected": totals[3] or 0,
                "injected": injected_graphs,
                "discarded": discarded,
            },
            "never_captured": [
                {"run": rid, "label": labels[rid], "batches": batches,
                 "message": never_captured_line(batches)}
                for rid, batches in sorted(waiting.items())
            ],
            "traffic": traffic.as_dict(),
            "eager": [
                {"reason": reason, "mode": mode, "batches": batches, "num_real_tokens": tokens}
                for (reason, mode), (batches, tokens) in sorted(eager.items(), key=lambda item: -item[1][0])
            ],
            "violations": {"findings": sum(kinds.values()), "by_kind": kinds, "injected": injected},
            "compile": {"by_kind": compile_kinds},
            "charts": {
                "series": [
                    {"t": start, "hit_ratio": t.hit_ratio, "padding_waste": t.padding_waste,
                     "replays": t.replays, "eager_batches": t.eager_batches}
                    for start, t in self.rollup.series(scope)
                ],
                "waste_by_size": [
                    {"mode": mode, "captured_size": size, "replays": t.replays,
                     "padding_waste": t.padding_waste}
                    for (size, mode), t in sorted(by_size.items())
                ],
                "batch_sizes": [
                    {"num_real_tokens": n, "batches": b} for n, b in self.rollup.batch_sizes(scope).items()
                ],
                "capture_sizes": sorted({size for _, _, _, size, _ in memory}),
                "graph_memory": [
                    {"id": gid, "run_id": rid, "mode": mode, "captured_size": size, "pool_bytes": pool}
                    for gid, rid, mode, size, pool in memory
                ],
            },
        }

    # Violations

    def violations(
        self, *, run_id: int | None = None, kind: str | None = None, page: int = 1, per_page: int = 50
    ) -> Page:
        """Violations, newest first."""
        filters = equal((Violation.run_id, run_id), (Violation.kind, kind))
        with self._session() as session:
            total, rows = page_of(session, Violation, filters, VIOLATION_ORDER, page, per_page)
            items = with_divergences(session, fields.linked_violations(session, rows))
            return Page(items, page, per_page, total)

    def violation(self, violation_id: int) -> dict[str, Any] | None:
        with self._session() as session:
            found = session.get(Violation, violation_id)
            if found is None:
                return None
            return with_divergences(session, fields.linked_violations(session, [found]))[0]

    # torch.compile

    def compile_events(
        self, *, run_id: int | None = None, kind: str | None = None, page: int = 1, per_page: int = 50
    ) -> Page:
        """torch.compile's skips and re-records, the most repeated first: each with the compiler's reason."""
        filters = equal((CompileRecord.run_id, run_id), (CompileRecord.kind, kind))
        order = [CompileRecord.count.desc(), CompileRecord.last_seen_at.desc(), CompileRecord.id.desc()]
        with self._session() as session:
            total, rows = page_of(session, CompileRecord, filters, order, page, per_page)
            return Page([fields.compile_event(r) for r in rows], page, per_page, total)

    def compile_event(self, event_id: int) -> dict[str, Any] | None:
        with self._session() as session:
            found = session.get(CompileRecord, event_id)
            return fields.compile_event(found) if found else None
