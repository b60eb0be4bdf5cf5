"""The captured graphs: the graph listing and its per-function totals, one graph in full, and the
start-up graphs that the advice's cost model is fitted to."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select

from inspector.advice.costs import RecordedGraph
from inspector.advice.weighing import CUDA_EVENTS
from inspector.reading import fields
from inspector.reading.divergences import with_divergences
from inspector.reading.graph_worth import graph_worth
from inspector.reading.listing import VIOLATION_ORDER, Page, equal, page_of
from inspector.reading.run_queries import RunQueries
from inspector.reading.traffic import TrafficTotals, integer_sum, replay_totals, run_traffic
from inspector.storage.models import Graph, ReplayTotal, ReplayWindow, StepTime, Violation

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

HISTORY_WINDOWS = 500
"""How many of a graph's most recent replay windows its page charts."""


class GraphQueries(RunQueries):
    """The graphs the runs captured, and their replays."""

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
        filters = equal((Graph.run_id, run_id), (Graph.mode, mode), (Graph.captured_size, size))
        column = GRAPH_SORTS[sort]
        order = [column.desc() if descending else column.asc(), Graph.id.desc() if descending else Graph.id]
        if by_function:
            order.insert(0, Graph.wrapper)
        with self._session() as session:
            total, graphs = page_of(session, Graph, filters, order, page, per_page)
            ids = [g.id for g in graphs]
            traffic = replay_totals(session, ReplayTotal.graph_id, graph_ids=ids)
            injected = fields.injected_captures(session, graph_ids=ids)
            none = TrafficTotals()
            worth = graph_worth(session, graphs, {g.id: traffic.get((g.id,), none).replays for g in graphs})
            items = [
                {**fields.graph(g), "injected": g.id in injected,
                 "traffic": traffic.get((g.id,), none).as_dict(),
                 "step_time": worth[g.id].as_dict() if g.id in worth else None}
                for g in graphs
            ]
        return Page(items, page, per_page, total)

    def start_up_graphs(self, run_ids: Sequence[int] | None = None) -> list[RecordedGraph]:
        """Each graph the runs (every run when None) captured at start-up, not the unexpected ones, in
        capture order: what the advice's cost model is fitted to."""
        query = select(Graph.captured_size, Graph.capture_seconds, Graph.pool_bytes, Graph.run_id).where(
            Graph.unexpected.is_(False), Graph.discarded.is_(False))
        if run_ids is not None:
            query = query.where(Graph.run_id.in_(run_ids))
        with self._session() as session:
            return [
                RecordedGraph(captured_size=int(size), capture_seconds=float(seconds), pool_bytes=int(pool),
                              run_id=int(run))
                for size, seconds, pool, run in session.execute(query.order_by(Graph.id))
            ]

    def step_times_by_size(
        self, run_ids: Sequence[int] | None = None
    ) -> tuple[list[tuple[int, float, int, float, int]], list[str]]:
        """Per size, the runs' (every run when None) timed steps summed: (size, graph seconds, graph
        samples, eager seconds, eager samples), by captured size (an eager fallback's: its real
        tokens); and the clocks that timed them. Where some were timed by CUDA events, those alone
        are summed (the eager backend's host-clock times are of the model re-run, not of a graph)."""
        t = StepTime
        scope = [] if run_ids is None else [t.run_id.in_(run_ids)]
        with self._session() as session:
            clocks = sorted(session.scalars(select(t.clock).where(*scope).distinct()))
            if CUDA_EVENTS in clocks:
                scope.append(t.clock == CUDA_EVENTS)
            rows = session.execute(
                select(t.captured_size, func.sum(t.graph_seconds), integer_sum(t.graph_samples),
                       func.sum(t.eager_seconds), integer_sum(t.eager_samples))
                .where(*scope).group_by(t.captured_size).order_by(t.captured_size)
            ).all()
        return [(int(size), float(gs or 0), int(gn or 0), float(es or 0), int(en or 0))
                for size, gs, gn, es, en in rows], clocks

    def decode_query_lens(self, run_ids: Sequence[int] | None = None) -> list[int]:
        """The tokens each request decodes in the runs' (every run when None) uniform-decode graphs
        (their captured size over their requests: 1 without speculative decoding), distinct."""
        query = select(Graph.captured_size, Graph.num_reqs).where(Graph.uniform.is_(True),
                                                                  Graph.num_reqs.is_not(None)).distinct()
        if run_ids is not None:
            query = query.where(Graph.run_id.in_(run_ids))
        with self._session() as session:
            rows = session.execute(query).all()
        return sorted({size // reqs for size, reqs in rows if reqs and size % reqs == 0})

    def recorded_traffic(
        self, run_ids: Sequence[int] | None = None
    ) -> tuple[TrafficTotals, dict[int, TrafficTotals]]:
        """The runs' (every run when None) traffic as the Overview reads it, in all and per captured
        size (every mode of a size together)."""
        with self._session() as session:
            by_size = replay_totals(session, ReplayTotal.captured_size, run_ids=run_ids)
            return run_traffic(session, run_ids), {size: totals for (size,), totals in by_size.items()}

    def graph_functions(
        self, *, run_id: int | None = None, mode: str | None = None, size: int | None = None
    ) -> dict[str, dict[str, int]]:
        """Per function that captured graphs (``wrapper``): its graphs, pool memory and replays."""
        filters = equal((Graph.run_id, run_id), (Graph.mode, mode), (Graph.captured_size, size))
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
            traffic = replay_totals(session, graph_ids=[graph_id]).get((), TrafficTotals())
            worth = graph_worth(session, [graph], {graph_id: traffic.replays}).get(graph_id)
            return {
                **fields.graph(graph),
                "injected": bool(fields.injected_captures(session, graph_ids=[graph_id])),
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
                "traffic": traffic.as_dict(),
                "step_time": None if worth is None else worth.as_dict(),
                "history": [_window_fields(*window) for window in reversed(windows)],
                "violations": with_divergences(session, fields.linked_violations(session, violations)),
            }


def _window_fields(start: float, end: float, replays: int, real: int, padding: int) -> dict[str, Any]:
    """One replay window of a graph's history, with its padding waste."""
    traffic = TrafficTotals(replays, real, padding)
    return {"start": start, "end": end, "replays": replays, "num_real_tokens": real,
            "padding_tokens": padding, "padding_waste": traffic.padding_waste}
