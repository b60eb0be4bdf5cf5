"""The read side of the database: every question the dashboard, its JSON API and the CLI ask.

Answers are plain JSON-ready dictionaries (rows read as ``inspector.fields`` spells them), so that a
page and its JSON twin are built from the same data. Times are UNIX epoch seconds, memory is bytes,
ratios are 0..1 (None when there is nothing to divide). Traffic figures are ``TrafficTotals`` read
from the running-totals tables (``inspector.traffic``, as the Prometheus collector and the CI report
read them, so they agree); traffic over time, the batch-size histogram and the violation counts
come from the in-memory ``Rollup`` (see ``inspector.rollup``); everything else is an indexed query
over small result sets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, case, func, select
from sqlalchemy.orm import Session

from capture_core.events import ViolationKind
from inspector import fields
from inspector.baseline import run_figures
from inspector.gate import compare
from inspector.losses import Losses, Sidecar, run_losses
from inspector.metrics import LIVE_AFTER_S
from inspector.models import CompileRecord, EagerTotal, Graph, ReplayTotal, ReplayWindow, Run, Violation
from inspector.ranks import captured_graphs, job_runs, rank_matrix
from inspector.rollup import Rollup
from inspector.traffic import (
    TrafficTotals,
    eager_totals,
    integer_sum,
    replay_totals,
    run_traffic,
    traffic_per_run,
)

GRAPH_SORTS = {
    "id": Graph.id,
    "run": Graph.run_id,
    "mode": Graph.mode,
    "size": Graph.captured_size,
    "capture_seconds": Graph.capture_seconds,
    "pool_bytes": Graph.pool_bytes,
    "captured_at": Graph.captured_at,
}
"""The columns the graphs table may be sorted by (the API's ``sort=`` values)."""

COMPILE_KINDS = ("compile_skip", "compile_rerecord")
"""What ``graph-inspector watch`` records of torch.compile's cudagraph trees (``compile_events``)."""

RANK_DIVERGENCE = ViolationKind.RANK_DIVERGENCE.value

VIOLATION_ORDER = (Violation.first_seen_at.desc(), Violation.id.desc())
"""Violations are listed newest first."""

HISTORY_WINDOWS = 500
"""How many of a graph's most recent replay windows its page charts."""


@dataclass(frozen=True)
class Page:
    """One page of a listing."""

    items: list[dict[str, Any]]
    page: int
    per_page: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    def meta(self) -> dict[str, int]:
        return {"page": self.page, "per_page": self.per_page, "total": self.total, "pages": self.pages}


class Queries:
    """Read-only questions over one inspector database. One instance serves all request threads."""

    def __init__(self, engine: Engine, *, now: Any = time.time) -> None:
        self.engine = engine
        self.rollup = Rollup(engine)
        self.sidecar = Sidecar.of_engine(engine)
        self._now = now

    def _session(self) -> Session:
        return Session(self.engine)

    # Runs

    def run_exists(self, run_id: int) -> bool:
        with self._session() as session:
            return session.get(Run, run_id) is not None

    def run_options(self, selected: int | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """The newest runs (and ``selected``, however old), as (id, label, live) for run pickers."""
        with self._session() as session:
            runs = list(
                session.scalars(select(Run).order_by(Run.started_at.desc(), Run.id.desc()).limit(limit))
            )
            if selected is not None and all(r.id != selected for r in runs):
                runs += session.scalars(select(Run).where(Run.id == selected)).all()
            return [{"id": r.id, "label": fields.run_label(r), "live": self._is_live(r)} for r in runs]

    def live_run_ids(self, run_id: int | None = None) -> list[int]:
        """Runs recording now: not ended, flushed within ``LIVE_AFTER_S`` (of ``run_id`` only, if given)."""
        query = select(Run.id).where(Run.ended_at.is_(None), Run.last_seen_at >= self._now() - LIVE_AFTER_S)
        if run_id is not None:
            query = query.where(Run.id == run_id)
        with self._session() as session:
            return list(session.scalars(query.order_by(Run.id)))

    def runs(self, page: int = 1, per_page: int = 50) -> Page:
        """Runs, newest first, each with its graph, memory, traffic and violation totals."""
        with self._session() as session:
            total, runs = _page_of(session, Run, [], [Run.started_at.desc(), Run.id.desc()], page, per_page)
            items = self._run_rows(session, runs)
        return Page(items, page, per_page, total)

    def run(self, run_id: int) -> dict[str, Any] | None:
        with self._session() as session:
            run = session.get(Run, run_id)
            return self._run_rows(session, [run])[0] if run else None

    def compare_runs(self, a: int, b: int) -> dict[str, Any] | None:
        """Two runs side by side, with a per-capture-size table of both and the regression gate's
        verdicts for B against A (default thresholds, as `graph-inspector report --baseline A` gives
        them). None if either run is unknown."""
        with self._session() as session:
            run_a, run_b = session.get(Run, a), session.get(Run, b)
            if run_a is None or run_b is None:
                return None
            rows = self._run_rows(session, [run_a, run_b])
            sizes: dict[tuple[str, int], dict[str, Any]] = {}
            for side, run_id in (("a", a), ("b", b)):
                by_size = replay_totals(session, ReplayTotal.mode, ReplayTotal.captured_size,
                                        run_ids=[run_id])
                for (mode, size), traffic in by_size.items():
                    entry = sizes.setdefault((mode, size), _size_row(mode, size))
                    entry[side] = traffic.as_dict()
                graphs = session.execute(
                    select(Graph.mode, Graph.captured_size, integer_sum(Graph.pool_bytes),
                           func.count(Graph.id))
                    .where(Graph.run_id == run_id)
                    .group_by(Graph.mode, Graph.captured_size)
                ).all()
                for mode, size, pool, count in graphs:
                    entry = sizes.setdefault((mode, size), _size_row(mode, size))
                    entry[f"{side}_graphs"] = count
                    entry[f"{side}_pool_bytes"] = pool
            database = self.engine.url.render_as_string(hide_password=True)
            gate = compare(run_figures(session, a, database), run_figures(session, b, database))
        by_size = sorted(sizes.values(), key=lambda e: (e["mode"], e["captured_size"]))
        return {"a": rows[0], "b": rows[1], "by_size": by_size, "gate": gate.as_dict()}

    def _run_rows(self, session: Session, runs: Sequence[Run]) -> list[dict[str, Any]]:
        self.rollup.refresh()
        ids = [r.id for r in runs]
        graph_totals = {
            run_id: (count, pool, capture)
            for run_id, count, pool, capture in session.execute(
                select(Graph.run_id, func.count(Graph.id), integer_sum(Graph.pool_bytes),
                       func.sum(Graph.capture_seconds))
                .where(Graph.run_id.in_(ids))
                .group_by(Graph.run_id)
            )
        }
        traffic = traffic_per_run(session, ids)
        dropped = run_losses(session, self.sidecar, ids).runs
        rows = []
        for run in runs:
            count, pool, capture = graph_totals.get(run.id, (0, 0, 0.0))
            losses = dropped[run.id]
            rows.append({
                **fields.run(run),
                "dropped_events": losses.events,
                "dropped": losses.as_dict(),
                "live": self._is_live(run),
                "graphs": count,
                "pool_bytes": pool or 0,
                "capture_seconds": capture or 0.0,
                "traffic": traffic[run.id].as_dict(),
                "violations": sum(self.rollup.findings([run.id]).values()),
            })
        return rows

    def _losses(self, session: Session, run_id: int) -> Losses:
        return run_losses(session, self.sidecar, [run_id]).runs[run_id]

    def _is_live(self, run: Run) -> bool:
        return run.ended_at is None and self._now() - run.last_seen_at <= LIVE_AFTER_S

    # Ranks of a job

    def jobs(self, page: int = 1, per_page: int = 50) -> Page:
        """Distributed jobs, newest first: their ranks, and the rank divergences found in them."""
        r = Run
        newest = func.max(r.started_at)
        with self._session() as session:
            total = session.scalar(select(func.count(func.distinct(r.job))).where(r.job.is_not(None))) or 0
            rows = session.execute(
                select(r.job, func.count(func.distinct(r.rank)), func.max(r.world_size),
                       func.min(r.started_at), func.max(r.last_seen_at))
                .where(r.job.is_not(None))
                .group_by(r.job)
                .order_by(newest.desc(), r.job)
                .offset((page - 1) * per_page)
                .limit(per_page)
            ).all()
            divergences = dict(session.execute(
                select(r.job, integer_sum(Violation.count))
                .join(r, r.id == Violation.run_id)
                .where(r.job.in_([row[0] for row in rows]), Violation.kind == RANK_DIVERGENCE)
                .group_by(r.job)
            ).all())
            live = set(session.scalars(select(r.job).where(r.id.in_(self.live_run_ids()))))
        items = [
            {"job": job, "ranks": ranks, "world_size": world, "started_at": started, "last_seen_at": seen,
             "live": job in live, "divergences": divergences.get(job, 0)}
            for job, ranks, world, started, seen in rows
        ]
        return Page(items, page, per_page, total)

    def job_ranks(self, job: str | None = None) -> dict[str, Any] | None:
        """One job rank by rank (``job``, else the newest): each rank's run (its newest), a row per
        graph with a cell per rank (captured or not, replays, a divergence recorded for it or not),
        and the divergences, newest first. None if no run has that job; without a job and with no
        jobs recorded, an empty view."""
        with self._session() as session:
            if job is None:
                job = session.scalar(
                    select(Run.job).where(Run.job.is_not(None)).order_by(Run.started_at.desc(), Run.id.desc())
                    .limit(1)
                )
                if job is None:
                    return {"job": None, "world_size": None, "ranks": [], "graphs": [], "divergences": []}
            ranks = job_runs(session, job)
            if not ranks:
                return None
            run_ids = [rank.run_id for rank in ranks.values()]
            graphs = captured_graphs(session, run_ids)
            replays = replay_totals(session, ReplayTotal.run_id, ReplayTotal.mode, ReplayTotal.descriptor_key,
                                    run_ids=run_ids)
            found = session.scalars(
                select(Violation)
                .where(Violation.run_id.in_(run_ids), Violation.kind == RANK_DIVERGENCE)
                .order_by(*VIOLATION_ORDER)
            ).all()
            rank_of = {run.run_id: rank for rank, run in ranks.items()}
            divergences = [{"rank": rank_of[v.run_id], "violation": fields.violation(v)} for v in found]
            diverged = {(rank_of[v.run_id], v.mode, v.descriptor_key) for v in found}
            per_run = {run_id: sum(v.count for v in found if v.run_id == run_id) for run_id in run_ids}
            # One query for the runs, not one a rank.
            loaded = {run.id: run for run in session.scalars(select(Run).where(Run.id.in_(run_ids)))}
            runs = self._run_rows(session, [loaded[run_id] for run_id in run_ids])
        counts = {key: traffic.replays for key, traffic in replays.items()}
        return {
            "job": job,
            "world_size": max(run.world_size for run in ranks.values()),
            "ranks": [{"run": run, "divergences": per_run[run["id"]]} for run in runs],
            "graphs": rank_matrix(ranks, graphs, counts, diverged),
            "divergences": divergences,
        }

    # Overview

    def summary(self, run_id: int | None = None) -> dict[str, Any]:
        """The overview: totals and the chart series, for one run or (``None``) every run."""
        self.rollup.refresh()
        scope = None if run_id is None else [run_id]
        with self._session() as session:
            graph_filter = [] if run_id is None else [Graph.run_id == run_id]
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
            },
            "traffic": traffic.as_dict(),
            "eager": [
                {"reason": reason, "mode": mode, "batches": batches, "num_real_tokens": tokens}
                for (reason, mode), (batches, tokens) in sorted(eager.items(), key=lambda item: -item[1][0])
            ],
            "violations": {"findings": sum(kinds.values()), "by_kind": kinds},
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

    # Graphs

    def graphs(
        self,
        *,
        run_id: int | None = None,
        mode: str | None = None,
        size: int | None = None,
        sort: str = "id",
        descending: bool = False,
        by_function: bool = False,
        page: int = 1,
        per_page: int = 50,
    ) -> Page:
        """Captured graphs, filtered and sorted (``sort`` is a key of ``GRAPH_SORTS``); with
        ``by_function``, the graphs of one function (``wrapper``: who captured them) come together."""
        filters = _equal((Graph.run_id, run_id), (Graph.mode, mode), (Graph.captured_size, size))
        column = GRAPH_SORTS[sort]
        order = [column.desc() if descending else column.asc(), Graph.id.desc() if descending else Graph.id]
        if by_function:
            order.insert(0, Graph.wrapper)
        with self._session() as session:
            total, graphs = _page_of(session, Graph, filters, order, page, per_page)
            traffic = replay_totals(session, ReplayTotal.graph_id, graph_ids=[g.id for g in graphs])
            none = TrafficTotals()
            items = [{**fields.graph(g), "traffic": traffic.get((g.id,), none).as_dict()} for g in graphs]
        return Page(items, page, per_page, total)

    def start_up_graphs(self, run_ids: Sequence[int] | None = None) -> list[tuple[int, float, int]]:
        """(captured size, capture seconds, pool bytes) of each graph the runs (every run when None)
        captured at start-up, not the unexpected ones: what the advice's cost model is fitted to."""
        query = select(Graph.captured_size, Graph.capture_seconds, Graph.pool_bytes).where(
            Graph.unexpected.is_(False))
        if run_ids is not None:
            query = query.where(Graph.run_id.in_(run_ids))
        with self._session() as session:
            return [(int(size), float(seconds), int(pool)) for size, seconds, pool in session.execute(
                query.order_by(Graph.id))]

    def graph_functions(
        self, *, run_id: int | None = None, mode: str | None = None, size: int | None = None
    ) -> dict[str, dict[str, int]]:
        """Per function that captured graphs (``wrapper``): its graphs, pool memory and replays."""
        filters = _equal((Graph.run_id, run_id), (Graph.mode, mode), (Graph.captured_size, size))
        replays = (
            select(ReplayTotal.graph_id, integer_sum(ReplayTotal.replays).label("replays"))
            .group_by(ReplayTotal.graph_id)
            .subquery()
        )
        query = (
            select(Graph.wrapper, func.count(Graph.id), integer_sum(Graph.pool_bytes),
                   integer_sum(func.coalesce(replays.c.replays, 0)))
            .outerjoin(replays, replays.c.graph_id == Graph.id)
            .where(*filters)
            .group_by(Graph.wrapper)
        )
        with self._session() as session:
            return {
                wrapper: {"graphs": count, "pool_bytes": pool or 0, "replays": replayed or 0}
                for wrapper, count, pool, replayed in session.execute(query)
            }

    def graph(self, graph_id: int) -> dict[str, Any] | None:
        """One graph in full: what it baked in, its run, its replay history and its violations."""
        with self._session() as session:
            graph = session.get(Graph, graph_id)
            if graph is None:
                return None
            windows = session.execute(
                select(ReplayWindow.window_start, ReplayWindow.window_end, ReplayWindow.replays,
                       ReplayWindow.num_real_tokens, ReplayWindow.padding_tokens)
                .where(ReplayWindow.graph_id == graph_id)
                .order_by(ReplayWindow.window_start.desc())
                .limit(HISTORY_WINDOWS)
            ).all()
            violations = session.scalars(
                select(Violation)
                .where(Violation.run_id == graph.run_id, Violation.descriptor_key == graph.descriptor_key,
                       Violation.mode == graph.mode)
                .order_by(*VIOLATION_ORDER)
                .limit(20)
            ).all()
            names = json.loads(graph.input_names or "[]")
            addresses = json.loads(graph.input_addresses or "[]")
            slices = json.loads(graph.ubatch_slices or "[]")
            return {
                **fields.graph(graph),
                "run": fields.run(graph.run) | {
                    "live": self._is_live(graph.run),
                    "dropped_events": self._losses(session, graph.run_id).events,
                },
                "warmup_iters": graph.warmup_iters,
                "inputs": [
                    {"name": name, "address": address, "address_hex": fields.address_hex(address)}
                    for name, address in zip(names, addresses, strict=False)
                ],
                "ubatch_slices": [
                    {"req_start": s[0], "req_stop": s[1], "token_start": s[2], "token_stop": s[3]}
                    for s in slices
                ],
                "traffic": replay_totals(session, graph_ids=[graph_id]).get((), TrafficTotals()).as_dict(),
                "history": [_window_fields(*window) for window in reversed(windows)],
                "violations": [fields.violation(v) for v in violations],
            }

    # Violations

    def violations(
        self, *, run_id: int | None = None, kind: str | None = None, page: int = 1, per_page: int = 50
    ) -> Page:
        """Violations, newest first."""
        filters = _equal((Violation.run_id, run_id), (Violation.kind, kind))
        with self._session() as session:
            total, rows = _page_of(session, Violation, filters, VIOLATION_ORDER, page, per_page)
            return Page([fields.violation(v) for v in rows], page, per_page, total)

    def violation(self, violation_id: int) -> dict[str, Any] | None:
        with self._session() as session:
            found = session.get(Violation, violation_id)
            return fields.violation(found) if found else None

    # torch.compile

    def compile_events(
        self, *, run_id: int | None = None, kind: str | None = None, page: int = 1, per_page: int = 50
    ) -> Page:
        """torch.compile's skips and re-records, the most repeated first: each with the compiler's reason."""
        filters = _equal((CompileRecord.run_id, run_id), (CompileRecord.kind, kind))
        order = [CompileRecord.count.desc(), CompileRecord.last_seen_at.desc(), CompileRecord.id.desc()]
        with self._session() as session:
            total, rows = _page_of(session, CompileRecord, filters, order, page, per_page)
            return Page([fields.compile_event(r) for r in rows], page, per_page, total)

    def compile_event(self, event_id: int) -> dict[str, Any] | None:
        with self._session() as session:
            found = session.get(CompileRecord, event_id)
            return fields.compile_event(found) if found else None


def _window_fields(start: float, end: float, replays: int, real: int, padding: int) -> dict[str, Any]:
    """One replay window of a graph's history, with its padding waste."""
    traffic = TrafficTotals(replays, real, padding)
    return {"start": start, "end": end, "replays": replays, "num_real_tokens": real,
            "padding_tokens": padding, "padding_waste": traffic.padding_waste}


def _size_row(mode: str, size: int) -> dict[str, Any]:
    """One capture size of a run comparison: graphs and pool memory, then traffic, per side."""
    return {"mode": mode, "captured_size": size, "a_graphs": 0, "a_pool_bytes": 0, "b_graphs": 0,
            "b_pool_bytes": 0, "a": None, "b": None}


def _equal(*pairs: tuple[Any, Any]) -> list[Any]:
    """``column == value`` for every pair whose value is given (None: no filter on that column)."""
    return [column == value for column, value in pairs if value is not None]


def _page_of(
    session: Session, model: Any, filters: Sequence[Any], order: Sequence[Any], page: int, per_page: int
) -> tuple[int, list[Any]]:
    """How many rows of ``model`` match ``filters``, and the ``page``-th ``per_page`` of them in ``order``."""
    total = session.scalar(select(func.count(model.id)).where(*filters)) or 0
    rows = session.scalars(
        select(model).where(*filters).order_by(*order).offset((page - 1) * per_page).limit(per_page)
    ).all()
    return total, list(rows)
