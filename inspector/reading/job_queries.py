"""The distributed jobs: the job listing, and one job rank by rank (``inspector.ranks.check``'s matrix)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from capture_core.events import ViolationKind
from inspector.ranks.check import captured_graphs, job_runs, rank_matrix
from inspector.reading import fields
from inspector.reading.divergences import with_divergences
from inspector.reading.listing import VIOLATION_ORDER, Page
from inspector.reading.run_queries import RunQueries
from inspector.reading.traffic import replay_totals
from inspector.storage.models import ReplayTotal, Run, Violation

RANK_DIVERGENCE = ViolationKind.RANK_DIVERGENCE.value


class JobQueries(RunQueries):
    """The ranks of a job, side by side."""

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
            jobs = [row[0] for row in rows]
            divergences = dict(session.execute(  # findings, as the job's ranks page counts them
                select(r.job, func.count(Violation.id))
                .join(r, r.id == Violation.run_id)
                .where(r.job.in_(jobs), Violation.kind == RANK_DIVERGENCE)
                .group_by(r.job)
            ).all())
            # When every run of a job has ended, the job has: its last run's end.
            ended = dict(session.execute(
                select(r.job, func.max(r.ended_at)).where(r.job.in_(jobs)).group_by(r.job)
                .having(func.count(r.id) == func.count(r.ended_at))
            ).all())
            live = set(session.scalars(select(r.job).where(r.id.in_(self.live_run_ids()))))
        items = [
            {"job": job, "ranks": ranks, "world_size": world, "started_at": started, "last_seen_at": seen,
             "ended_at": ended.get(job), "live": job in live, "divergences": divergences.get(job, 0)}
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
            listed = with_divergences(session, fields.linked_violations(session, found))
            divergences = [{"rank": rank_of[v.run_id], "violation": item} for v, item in zip(found, listed,
                                                                                              strict=True)]
            diverged = {(rank_of[v.run_id], v.mode, v.descriptor_key) for v in found}
            per_run = {run_id: sum(1 for v in found if v.run_id == run_id) for run_id in run_ids}  # findings
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
