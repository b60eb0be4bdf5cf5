"""The advice: how many capture sizes the budgets allow, which ones, and what they change.

``advise`` takes the observed histogram and the current capture sizes, works out how many sizes
may be captured (``max_graphs``, and the capture-time and memory budgets through the recorded cost
model), picks the optimal set for that count and projects both sets on the same histogram.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inspector.advice.costs import CostModel
from inspector.advice.sizes import Histogram, Projection, StepCost, best_choices, project, tokens
from inspector.errors import UsageError

CURVE_GRAPHS = 128
"""The waste curve runs over 1..this many graphs (or up to every candidate size, if fewer; or up to
the advised count, if more): the knee of real traffic comes long before, and each graph count is
one more layer of the optimiser."""


@dataclass(frozen=True)
class Advice:
    """Advised capture sizes against the current ones, on one histogram."""

    histogram: Histogram
    source: str
    max_size: int
    graphs: int
    bounded_by: str
    """What decided the number of graphs (``--max-graphs``, a budget, the current count, ...)."""
    current: Projection
    advised: Projection
    curve: tuple[Projection, ...]
    """The best set for each graph count 1..N, projected: the waste-against-graphs curve."""
    costs: CostModel | None
    weighed_by_step_time: bool

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.advised.capture_sizes


def advise(
    histogram: Histogram,
    current_sizes: Sequence[int],
    *,
    source: str,
    max_graphs: int | None = None,
    capture_time_budget: float | None = None,
    memory_budget_bytes: float | None = None,
    max_size: int | None = None,
    costs: CostModel | None = None,
    step_cost: StepCost | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """Advise capture sizes for ``histogram``; ``UsageError`` for what cannot be advised, and why."""
    if not histogram.total:
        raise UsageError(f"{source}: no batches recorded, so there is nothing to advise on")
    if not current_sizes:
        raise UsageError(f"{source} captured no graphs at start-up, so there is no current configuration to "
                         "compare with: name one with --current (pow2, vllm or sizes such as 1,2,4,8)")
    top = histogram.largest if max_size is None else max_size
    if top < histogram.sizes[0]:
        raise UsageError(f"--max-size {top} is below every observed batch (the smallest is "
                         f"{histogram.sizes[0]}): every batch would run eagerly")
    if (capture_time_budget is not None or memory_budget_bytes is not None) and costs is None:
        raise UsageError("a capture-time or memory budget needs the capture costs a run recorded: "
                         "advise from --db, not --trace")
    graphs, bounded_by = _graph_count(top, current_sizes, max_graphs, capture_time_budget,
                                      memory_budget_bytes, costs)
    choices = best_choices(histogram, top, max(graphs, CURVE_GRAPHS), step_cost or tokens, progress)
    chosen = choices[min(graphs, len(choices)) - 1]
    return Advice(
        histogram=histogram,
        source=source,
        max_size=top,
        graphs=chosen.graphs,
        bounded_by=bounded_by if chosen.graphs == graphs else f"every candidate size ({chosen.graphs})",
        current=project(histogram, current_sizes),
        advised=project(histogram, chosen.sizes),
        curve=tuple(project(histogram, c.sizes) for c in choices),
        costs=costs,
        weighed_by_step_time=step_cost is not None,
    )


def _graph_count(
    top: int,
    current_sizes: Sequence[int],
    max_graphs: int | None,
    seconds: float | None,
    memory_bytes: float | None,
    costs: CostModel | None,
) -> tuple[int, str]:
    """How many capture sizes to advise, and what set that number."""
    limits: list[tuple[int, str]] = []
    if max_graphs is not None:
        limits.append((max_graphs, f"--max-graphs {max_graphs}"))
    if costs is not None and (seconds is not None or memory_bytes is not None):
        try:
            allowed = costs.most_sizes(top, seconds, memory_bytes)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if allowed is not None:
            limits.append((allowed, "the budgets"))
    if not limits:
        current = len(set(current_sizes))
        return current, f"the current configuration's count ({current})"
    return min(limits)
