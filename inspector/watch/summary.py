"""What a watched run left in the database, read back: the summary ``graph-inspector watch`` prints.

Read from the database rather than from memory because the graphs live in the watched processes
(one per rank), not in the command that launched them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import func, select

from inspector.gating.report import compile_line
from inspector.storage.models import CompileRecord, Graph, ReplayWindow, Run, Violation
from inspector.storage.store import Store


@dataclass(frozen=True)
class GraphLine:
    run_id: int
    rank: int
    key: str
    site: str
    captured_size: int
    pool_bytes: int
    capture_seconds: float
    unexpected: bool
    replays: int


@dataclass
class WatchSummary:
    runs: list[Run] = field(default_factory=list)
    graphs: list[GraphLine] = field(default_factory=list)
    violations: dict[str, int] = field(default_factory=dict)
    """kind -> occurrences (a finding's count, summed)."""
    compile_events: list[CompileRecord] = field(default_factory=list)

    @property
    def never_replayed(self) -> list[GraphLine]:
        return [g for g in self.graphs if g.replays == 0]

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)

    def render(self) -> str:
        """A short plain-text report."""
        pool_mib = sum(g.pool_bytes for g in self.graphs) / 2**20
        lines = [
            f"{len(self.runs)} watched process(es), {len(self.graphs)} graph(s), "
            f"{self.replays} replay(s), {pool_mib:.1f} MiB of pool memory"
        ]
        for graph in self.graphs:
            flag = "  UNEXPECTED" if graph.unexpected else ""
            lines.append(
                f"  rank {graph.rank}  {graph.replays:>9} replays  {graph.pool_bytes / 2**20:8.1f} MiB  "
                f"{graph.key}{flag}"
            )
        if self.never_replayed:
            lines.append(f"never replayed: {len(self.never_replayed)} graph(s)")
        for kind, count in sorted(self.violations.items()):
            lines.append(f"violations: {kind} x{count}")
        for event in self.compile_events:
            lines.append(compile_line(event.kind, event.function, event.count, event.reason))
        return "\n".join(lines)


def watch_summary(
    store: Store, label: str | None = None, run_ids: Sequence[int] | None = None
) -> WatchSummary:
    """Everything recorded by the runs with ``label`` (or the given ids)."""
    summary = WatchSummary()
    with store.session() as session:
        query = select(Run).order_by(Run.rank, Run.id)
        if run_ids is not None:
            query = query.where(Run.id.in_(list(run_ids)))
        if label is not None:
            query = query.where(Run.label == label)
        summary.runs = list(session.scalars(query))
        ids = [run.id for run in summary.runs]
        if not ids:
            return summary
        ranks = {run.id: run.rank for run in summary.runs}
        window = ReplayWindow
        replays = {
            (run_id, key): int(total)
            for run_id, key, total in session.execute(
                select(window.run_id, window.descriptor_key, func.sum(window.replays))
                .where(window.run_id.in_(ids))
                .group_by(window.run_id, window.descriptor_key)
            )
        }
        graphs = select(Graph).where(Graph.run_id.in_(ids)).order_by(Graph.run_id, Graph.id)
        for graph in session.scalars(graphs):
            summary.graphs.append(
                GraphLine(
                    run_id=graph.run_id,
                    rank=ranks[graph.run_id],
                    key=graph.descriptor_key,
                    site=graph.wrapper,
                    captured_size=graph.captured_size,
                    pool_bytes=graph.pool_bytes,
                    capture_seconds=graph.capture_seconds,
                    unexpected=graph.unexpected,
                    replays=replays.get((graph.run_id, graph.descriptor_key), 0),
                )
            )
        by_kind = select(Violation.kind, func.sum(Violation.count)).where(Violation.run_id.in_(ids))
        summary.violations = {kind: int(n) for kind, n in session.execute(by_kind.group_by(Violation.kind))}
        summary.compile_events = list(
            session.scalars(
                select(CompileRecord).where(CompileRecord.run_id.in_(ids)).order_by(CompileRecord.first_seen_at)
            )
        )
    return summary
