"""What a graph is worth: its step time against the same step run eagerly, one formula for each figure.

From the ``step_times`` running totals (``capture_core.step_time`` times the sampled replays, the
canary's eager steps and a sampled share of the eager fallbacks): a graph's mean replay time, the
mean eager time at the same size (its own canary steps, which run the very step it replays; else
the run's eager fallbacks of exactly its captured size), the speedup (eager over graph), and the
time it saved over the run so far ((eager - graph) x its replays). Two marks, advice and not
violations, for graphs of a real graph backend: *not faster* (speedup at most 1) and *capture not
repaid* (it saved less than its capture took). On the eager backend the figures are the host's
clock around re-running the model, shown as such and never marked.

The graph page, the graphs list, ``/metrics`` and ``graph-inspector report`` read these figures from
here, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from inspector.storage.models import Graph, StepTime

NONE_MODE = "none"
"""The mode an eager fallback's step time is keyed by (``CUDAGraphMode.NONE``: no graph ran)."""
EAGER_BACKEND = "eager"

NOT_FASTER = "not_faster"
CAPTURE_NOT_REPAID = "capture_not_repaid"
MARKS = {
    NOT_FASTER: "its replay is not faster than the same step run eagerly",
    CAPTURE_NOT_REPAID: "it has saved less time than its capture took",
}
"""Mark -> what it says (the pages, the report and the metric's help use these)."""


@dataclass(frozen=True)
class Timed:
    """Sums of some timed steps: seconds and how many."""

    seconds: float = 0.0
    samples: int = 0

    @property
    def mean(self) -> float | None:
        return self.seconds / self.samples if self.samples else None

    def plus(self, other: Timed) -> Timed:
        return Timed(self.seconds + other.seconds, self.samples + other.samples)


@dataclass(frozen=True)
class GraphWorth:
    """One graph's step time against eager at its size, and what that says of it."""

    clock: str
    graph: Timed
    eager: Timed
    eager_from: str | None
    """``canary`` (the graph's own eager steps), ``eager_fallbacks`` (of its captured size), or None."""
    replays: int
    capture_seconds: float
    backend: str

    @property
    def speedup(self) -> float | None:
        """Eager time over graph time at the same size (None until both are timed)."""
        graph, eager = self.graph.mean, self.eager.mean
        if graph is None or eager is None or graph <= 0:
            return None
        return eager / graph

    @property
    def saved_seconds(self) -> float | None:
        """What replaying saved over running eagerly, over the run's replays so far."""
        graph, eager = self.graph.mean, self.eager.mean
        if graph is None or eager is None:
            return None
        return (eager - graph) * self.replays

    @property
    def marks(self) -> tuple[str, ...]:
        """``not_faster``, ``capture_not_repaid``: only for a real graph backend, once both are timed."""
        speedup, saved = self.speedup, self.saved_seconds
        if self.backend == EAGER_BACKEND or speedup is None or saved is None:
            return ()
        found = []
        if speedup <= 1.0:
            found.append(NOT_FASTER)
        if saved < self.capture_seconds:
            found.append(CAPTURE_NOT_REPAID)
        return tuple(found)

    def as_dict(self) -> dict[str, Any]:
        """The JSON fields of a graph's ``step_time``."""
        return {
            "clock": self.clock,
            "graph_seconds": self.graph.mean,
            "graph_samples": self.graph.samples,
            "eager_seconds": self.eager.mean,
            "eager_samples": self.eager.samples,
            "eager_from": self.eager_from,
            "speedup": self.speedup,
            "saved_seconds": self.saved_seconds,
            "marks": [{"mark": mark, "says": MARKS[mark]} for mark in self.marks],
        }


def graph_worth(session: Session, graphs: Sequence[Graph], replays: dict[int, int]) -> dict[int, GraphWorth]:
    """Graph id -> its worth, for the ``graphs`` that have a timed replay or eager step (``replays``:
    graph id -> its replays). Two queries, whatever the number of graphs."""
    if not graphs:
        return {}
    own = {row.graph_id: row for row in session.scalars(
        select(StepTime).where(StepTime.graph_id.in_([g.id for g in graphs])))}
    sizes = {(g.run_id, g.captured_size) for g in graphs}
    fallbacks: dict[tuple[int, int], tuple[Timed, str]] = {}
    for row in session.scalars(select(StepTime).where(
        StepTime.mode == NONE_MODE, tuple_(StepTime.run_id, StepTime.captured_size).in_(sorted(sizes)),
    )):
        key = (row.run_id, row.captured_size)
        timed = fallbacks.get(key, (Timed(), row.clock))[0].plus(Timed(row.eager_seconds, row.eager_samples))
        fallbacks[key] = (timed, row.clock)
    found = {}
    for graph in graphs:
        row = own.get(graph.id)
        fallback, fallback_clock = fallbacks.get((graph.run_id, graph.captured_size), (Timed(), None))
        if row is None and not fallback.samples:
            continue
        timed = Timed(row.graph_seconds, row.graph_samples) if row is not None else Timed()
        eager = Timed(row.eager_seconds, row.eager_samples) if row is not None else Timed()
        eager_from = "canary" if eager.samples else None
        if not eager.samples and fallback.samples:
            eager, eager_from = fallback, "eager_fallbacks"
        clock = row.clock if row is not None else fallback_clock
        found[graph.id] = GraphWorth(clock, timed, eager, eager_from, replays.get(graph.id, 0),
                                     graph.capture_seconds, graph.backend)
    return found


def marked(worths: Iterable[GraphWorth]) -> dict[str, int]:
    """How many graphs carry each mark."""
    counts = dict.fromkeys(MARKS, 0)
    for worth in worths:
        for mark in worth.marks:
            counts[mark] += 1
    return counts
