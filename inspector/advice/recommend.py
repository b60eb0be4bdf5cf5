"""The advice: how many capture sizes the budgets allow, which ones, and what they change.

``advise`` takes the observed histogram and the current capture sizes, works out how many sizes
may be captured (``max_graphs``, and the capture-time and memory budgets through the recorded cost
model), picks the optimal set for that count, padding weighed as ``weighing`` says (step time where
recorded, else tokens), with the sizes ``include`` forces in and, weighed by time, the smallest size
held down so a lone request stays within ``LONE_REQUEST_SLACK`` of its best step; and compares it
with the current sizes: as recorded (``current``, the Overview's figures for the same runs) or
projected on the same histogram.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inspector.advice.costs import MIB, CostModel
from inspector.advice.engines import DecodeTraffic, EngineLists, engine_lists
from inspector.advice.sizes import Choice, Histogram, Projection, best_choices, project, tokens
from inspector.advice.weighing import (
    LONE_REQUEST_SLACK,
    LoneRequest,
    Weighing,
    lone_request,
    lone_request_limit,
    modelled_seconds,
)
from inspector.errors import UsageError

CURVE_GRAPHS = 128
"""The waste curve runs over 1..this many graphs (or up to every candidate size, if fewer; or up to
the advised count, if more): the knee of real traffic comes long before, and each graph count is
one more layer of the optimiser."""


@dataclass(frozen=True)
class TokenAdvice:
    """The sizes padding counted in tokens gives for the same graph count and forced sizes, and its
    modelled step time by the same step times: what weighing by time gained over it."""

    projection: Projection
    seconds: float | None

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.projection.capture_sizes

    def saved(self, advised_seconds: float | None) -> float | None:
        """The share of modelled step time the timed advice saves over this (0.001: 0.1%)."""
        if advised_seconds is None or not self.seconds:
            return None
        return 1 - advised_seconds / self.seconds


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
    weighing: Weighing
    included: tuple[int, ...] = ()
    """Sizes forced into the advice (``--include``)."""
    current_recorded: bool = False
    """``current`` is what the runs recorded (the Overview's figures), not a projection."""
    lone_request: LoneRequest | None = None
    current_seconds: float | None = None
    advised_seconds: float | None = None
    """The modelled step time of the batches each set replays, summed (weighed by time only)."""
    by_tokens: TokenAdvice | None = None
    """Weighed by time: what padding counted in tokens advises for the same count, for comparison."""
    engines: EngineLists | None = None
    """The advised sizes as each engine takes them (decode and prefill lists apart)."""
    gpu_memory_utilization: float | None = None
    """vLLM's current ``--gpu-memory-utilization`` and the GPU's memory, where given: the memory
    line then says the share that keeps the KV cache as it is (``inspector.advice.memory``)."""
    gpu_memory_bytes: float | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.advised.capture_sizes

    @property
    def weighed_by_step_time(self) -> bool:
        return self.weighing.by_time


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
    weighing: Weighing | None = None,
    include: Sequence[int] = (),
    lone_request_slack: float = LONE_REQUEST_SLACK,
    current: Projection | None = None,
    decode: DecodeTraffic | None = None,
    gpu_memory_utilization: float | None = None,
    gpu_memory_bytes: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """Advise capture sizes for ``histogram``; ``UsageError`` for what cannot be advised, and why.

    ``current``: the current sizes' traffic as recorded (else it is projected on the histogram);
    ``decode``: the decode steps apart, for the engines that keep decode graphs apart."""
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
    beyond = sorted(size for size in set(include) if size > top)
    if beyond:
        raise UsageError(f"--include {beyond[0]} is above the largest size advised ({top}); raise --max-size "
                         "or leave it out")
    weighing = weighing or Weighing.by_tokens("no step times given")
    graphs, bounded_by = _graph_count(top, current_sizes, max_graphs, capture_time_budget, costs)
    best, within, held = None, top, False
    if weighing.by_time:
        best, within = lone_request_limit(weighing.cost, top, lone_request_slack)
        # Hold the smallest size down unless every size keeps it so, or no batch that small was seen.
        held = within < top and histogram.sizes[0] <= within
    try:
        choices = best_choices(histogram, top, max(graphs, CURVE_GRAPHS), weighing.cost, progress,
                               forced=include, smallest_at_most=within if held else None)
    except ValueError as error:
        raise UsageError(f"cannot advise {graphs} sizes: {error}") from None
    fewest = choices[0].graphs
    if graphs < fewest:
        graphs, bounded_by = fewest, f"the sizes that must be in ({fewest})"
    chosen, by_memory = _fitting(choices, graphs, costs, memory_budget_bytes)
    if by_memory:
        graphs, bounded_by = chosen.graphs, f"the memory budget ({memory_budget_bytes / MIB:g} MiB of pool)"
    advised = project(histogram, chosen.sizes)
    timed = weighing.by_time
    by_tokens = _by_tokens(histogram, top, chosen.graphs, include, weighing) if timed else None
    return Advice(
        histogram=histogram,
        source=source,
        max_size=top,
        graphs=chosen.graphs,
        bounded_by=bounded_by if chosen.graphs == graphs else f"every candidate size ({chosen.graphs})",
        current=current if current is not None else project(histogram, current_sizes),
        advised=advised,
        curve=tuple(project(histogram, c.sizes) for c in choices),
        costs=costs,
        weighing=weighing,
        included=tuple(sorted(set(include))),
        current_recorded=current is not None,
        lone_request=(None if best is None else
                      lone_request(weighing, chosen.sizes, best, within, lone_request_slack, held)),
        current_seconds=modelled_seconds(histogram, current_sizes, weighing) if timed else None,
        advised_seconds=modelled_seconds(histogram, chosen.sizes, weighing) if timed else None,
        by_tokens=by_tokens,
        engines=engine_lists(chosen.sizes, histogram, decode, chosen.graphs, weighing.cost,
                             within if held else None),
        gpu_memory_utilization=gpu_memory_utilization,
        gpu_memory_bytes=gpu_memory_bytes,
    )


def _by_tokens(histogram: Histogram, top: int, graphs: int, include: Sequence[int], weighing: Weighing
               ) -> TokenAdvice:
    """The token-counted advice of ``graphs`` sizes (the same forced sizes), timed by ``weighing``."""
    choices = best_choices(histogram, top, graphs, tokens, forced=include)
    sizes = choices[min(graphs - choices[0].graphs, len(choices) - 1)].sizes
    return TokenAdvice(project(histogram, sizes), modelled_seconds(histogram, sizes, weighing))


def _graph_count(
    top: int,
    current_sizes: Sequence[int],
    max_graphs: int | None,
    seconds: float | None,
    costs: CostModel | None,
) -> tuple[int, str]:
    """How many capture sizes to advise, and what set that number (a memory budget is applied to
    the sets themselves, once they are known: what a set needs depends on its sizes)."""
    limits: list[tuple[int, str]] = []
    if max_graphs is not None:
        limits.append((max_graphs, f"--max-graphs {max_graphs}"))
    if costs is not None and seconds is not None:
        try:
            limits.append((costs.most_sizes(seconds), "the capture-time budget"))
        except ValueError as error:
            raise UsageError(str(error)) from None
    if not limits:
        current = len(set(current_sizes))
        return current, f"the current configuration's count ({current})"
    return min(limits)


def _fitting(choices: Sequence[Choice], graphs: int, costs: CostModel | None, memory_bytes: float | None
             ) -> tuple[Choice, bool]:
    """The choice of ``graphs`` sizes (or the most available), or of fewer where the pool they need
    (``inspector.advice.memory``) is over ``memory_bytes``: the second is True when memory set it."""
    fewest = choices[0].graphs
    wanted = choices[min(graphs - fewest, len(choices) - 1)]
    if memory_bytes is None or costs is None or costs.pool is None:
        return wanted, False
    fits = [c for c in choices if c.graphs <= wanted.graphs and costs.pool_bytes(c.sizes) <= memory_bytes]
    if not fits:
        alone = costs.pool_bytes(choices[0].sizes)
        raise UsageError(f"a memory budget of {memory_bytes / MIB:g} MiB fits no graph: the largest size, "
                         f"{choices[0].sizes[-1]}, needs {alone / MIB:.1f} MiB of pool with the sizes that "
                         "must be in")
    return fits[-1], fits[-1] is not wanted
