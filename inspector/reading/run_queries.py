"""The runs: the run listing and pickers, one run, two runs compared, and which runs are live.

``RunQueries`` holds what every part of the read side needs (the engine, the rollup, the losses'
sidecar, the clock) and the run rows (``_run_rows``) that the jobs' view embeds too; the other parts
of ``inspector.reading.queries.Queries`` build on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from inspector.gating.baseline import run_figures
from inspector.gating.gate import compare
from inspector.reading import fields
from inspector.reading.listing import Page, page_of
from inspector.reading.metrics import LIVE_AFTER_S
from inspector.reading.rollup import Rollup
from inspector.reading.traffic import integer_sum, replay_totals, traffic_per_run
from inspector.recording.losses import Losses, Sidecar, run_losses
from inspector.storage.models import Graph, ReplayTotal, Run


class RunQueries:
    """Read-only questions about the runs of one inspector database, and what the others share."""

    def __init__(self, engine: Engine, *, now: Any = time.time) -> None:
        self.engine = engine
        self.rollup = Rollup(engine)
        self.sidecar = Sidecar.of_engine(engine)
        self._now = now

    def _session(self) -> Session:
        return Session(self.engine)

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
            total, runs = page_of(session, Run, [], [Run.started_at.desc(), Run.id.desc()], page, per_page)
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
                    .where(Graph.run_id == run_id, Graph.discarded.is_(False))
                    .group_by(Graph.mode, Graph.captured_size)
                ).all()
                for mode, size, pool, count in graphs:
                    entry = sizes.setdefault((mode, size), _size_row(mode, size))
                    entry[f"{side}_graphs"] = count
                    entry[f"{side}_pool_bytes"] = pool
            database = self.engine.url.render_as_string(hide_password=True)
            gate = compare(run_figures(session, a, database), run_figures(session, b, database))
        by_size = sorted(sizes.values(), key=lambda e: (e["mode"], e["captured_size"]))
        config = config_rows(rows[0]["config"], rows[1]["config"])
        return {"a": rows[0], "b": rows[1], "by_size": by_size, "config": config, "gate": gate.as_dict()}

    def _run_rows(self, session: Session, runs: Sequence[Run]) -> list[dict[str, Any]]:
        self.rollup.refresh()
        ids = [r.id for r in runs]
        graph_totals = {
            run_id: (count, pool, capture)
            for run_id, count, pool, capture in session.execute(
                select(Graph.run_id, func.count(Graph.id), integer_sum(Graph.pool_bytes),
                       func.sum(Graph.capture_seconds))
                .where(Graph.run_id.in_(ids), Graph.discarded.is_(False))
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


def _size_row(mode: str, size: int) -> dict[str, Any]:
    """One capture size of a run comparison: graphs and pool memory, then traffic, per side."""
    return {"mode": mode, "captured_size": size, "a_graphs": 0, "a_pool_bytes": 0, "b_graphs": 0,
            "b_pool_bytes": 0, "a": None, "b": None}


def config_rows(a: Any, b: Any) -> list[dict[str, Any]]:
    """Two runs' configurations side by side, a row per setting (its value as compact JSON, a list on
    one line; None where the run has no such setting), the settings that differ first."""
    a = a if isinstance(a, dict) else {"config": a}
    b = b if isinstance(b, dict) else {"config": b}
    missing = object()

    def shown(value: Any) -> str | None:
        return None if value is missing else json.dumps(value, sort_keys=True)

    rows = [{"key": key, "a": shown(a.get(key, missing)), "b": shown(b.get(key, missing))}
            for key in sorted(a.keys() | b.keys())]
    for row in rows:
        row["differs"] = row["a"] != row["b"]
    return sorted(rows, key=lambda row: not row["differs"])
