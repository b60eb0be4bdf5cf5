"""The capture sizes a batch-size histogram wants: fewest padding tokens for a number of graphs.

A batch of ``n`` real tokens replays the smallest captured size ``s >= n`` and computes ``s - n``
padding tokens; above the largest captured size it runs eagerly. Given the histogram of real batch
sizes (every batch: replayed and eager) and a largest size that must stay captured (``max_size``,
so nothing falls back to eager that did not before), choose at most ``K`` sizes that minimise the
padding.

Exactly, and fast: an optimal set only uses observed sizes and ``max_size`` (lowering a size to
the largest observed size at or below it pads no batch more). Over the ``m`` distinct candidates it
is a partition of the sorted sizes into ``K`` runs, each padded up to its largest member: dynamic
programming, where a run's cost is read off prefix sums in O(1). That cost obeys the quadrangle
(Monge) inequality, so the best split points of a layer are monotone and divide and conquer fills
a layer in O(m log m); every ``K`` up to the largest asked comes out of one pass (the curve).

Padding can be weighed by what it costs rather than counted: ``step_cost(n)`` is the cost of a
step at ``n`` tokens (the token count itself by default; a measured step time makes three padding
tokens at 4 cheap and at 200 dear). The cost must not fall as ``n`` grows, which keeps the inequality.

Sizes can be forced in (``forced``): each is a candidate, and no run may pad across one (a run that
holds a forced size ends at it). A run across one costs infinity; that keeps the inequality too (a
run that spans another spans what it spans), and an end no run can reach yet searches every start.
Likewise ``smallest_at_most``: the first run (the smallest size) must end at or below it, so that
the smallest batches pad no further than that.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from inspector.reading.traffic import TrafficTotals

StepCost = Callable[[int], float]
"""What a step of ``n`` tokens costs; non-decreasing in ``n``."""


def tokens(n: int) -> float:
    """The default step cost: padding counted in tokens."""
    return float(n)


@dataclass(frozen=True)
class Histogram:
    """Batches per real batch size, ascending by size."""

    sizes: tuple[int, ...]
    batches: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.batches):
            raise ValueError("a histogram needs one batch count per size")
        if any(s < 1 for s in self.sizes) or any(b < 1 for b in self.batches):
            raise ValueError("batch sizes and batch counts must be positive")
        if any(a >= b for a, b in itertools.pairwise(self.sizes)):
            raise ValueError("histogram sizes must be distinct and ascending")

    @classmethod
    def of(cls, batch_sizes: Iterable[int]) -> Histogram:
        """The histogram of a sequence of batch sizes (one entry per batch)."""
        return cls.from_counts(Counter(batch_sizes))

    @classmethod
    def from_counts(cls, counts: Mapping[int, int]) -> Histogram:
        kept = sorted((int(size), int(n)) for size, n in counts.items() if n)
        return cls(tuple(s for s, _ in kept), tuple(n for _, n in kept))

    @property
    def total(self) -> int:
        return sum(self.batches)

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def __len__(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class Projection:
    """A set of capture sizes, and the traffic figures it makes of a histogram, in all and per size."""

    capture_sizes: tuple[int, ...]
    traffic: TrafficTotals
    by_size: tuple[TrafficTotals, ...]
    """The replays of each capture size (same order); eager batches belong to none."""


def project(histogram: Histogram, capture_sizes: Sequence[int]) -> Projection:
    """Replay ``histogram`` on ``capture_sizes``: replays, padding, eager batches (and so the hit ratio
    and the padding waste, by the inspector's one formula for each)."""
    table = sorted(set(capture_sizes))
    by_size = [TrafficTotals() for _ in table]
    total = TrafficTotals()
    for size, batches in zip(histogram.sizes, histogram.batches, strict=True):
        index = bisect.bisect_left(table, size)
        if index == len(table):
            total.eager_batches += batches
            continue
        replayed = TrafficTotals(batches, size * batches, (table[index] - size) * batches)
        by_size[index].add(replayed)
        total.add(replayed)
    return Projection(tuple(table), total, tuple(by_size))


@dataclass(frozen=True)
class Choice:
    """The best ``graphs`` capture sizes, and the padding cost they leave."""

    graphs: int
    sizes: tuple[int, ...]
    cost: float


def best_choices(
    histogram: Histogram,
    max_size: int,
    max_graphs: int,
    step_cost: StepCost = tokens,
    progress: Callable[[int, int], None] | None = None,
    forced: Iterable[int] = (),
    smallest_at_most: int | None = None,
) -> list[Choice]:
    """The optimal set for every graph count from the fewest that hold every ``forced`` size (and
    ``max_size``) to ``max_graphs`` (fewer where fewer candidates exist).

    Every set holds ``max_size`` and the ``forced`` sizes; batches above ``max_size`` are left out
    (they run eagerly whatever is captured). ``progress(done, total)`` is told after each layer.
    """
    if max_size < 1 or max_graphs < 1:
        raise ValueError("max_size and max_graphs must be positive")
    kept = sorted({s for s in forced if s < max_size})
    if kept and kept[0] < 1:
        raise ValueError("forced sizes must be positive")
    counts_of = {s: n for s, n in zip(histogram.sizes, histogram.batches, strict=True) if s <= max_size}
    candidates = sorted({*counts_of, *kept, max_size})
    counts = [counts_of.get(s, 0) for s in candidates]
    m = len(candidates)
    # prefix count of forced candidates: a run start..end-1 may hold one only as its last member.
    forced_set = set(kept)
    forced_before = [0] * (m + 1)
    for j, size in enumerate(candidates):
        forced_before[j + 1] = forced_before[j] + (size in forced_set)
    limit = max_size if smallest_at_most is None else smallest_at_most
    if limit < candidates[0]:
        raise ValueError(f"no candidate size is at or below {limit}, the smallest size allowed")
    needs_small = limit < min(kept[:1] or [max_size])
    fewest = len(kept) + 1 + needs_small
    if max_graphs < fewest:
        what = [f"{len(kept)} forced size(s)"] * bool(kept) + [f"a size at or below {limit}"] * needs_small
        raise ValueError(f"{' and '.join([*what, 'the largest size'])} need {fewest} graphs, more than "
                         f"the {max_graphs} allowed")
    price = [step_cost(s) for s in candidates]
    if any(b < a for a, b in itertools.pairwise(price)):
        raise ValueError("the step cost must not fall as the token count grows")
    # prefix[j] over candidates[:j]: batches, and batches x step cost.
    batches, weighted = [0] * (m + 1), [0.0] * (m + 1)
    for j in range(m):
        batches[j + 1] = batches[j] + counts[j]
        weighted[j + 1] = weighted[j] + counts[j] * price[j]

    inf = float("inf")

    def run_cost(start: int, end: int) -> float:
        """Candidates ``start..end-1`` padded up to ``candidates[end-1]`` (infinite across a forced one)."""
        if forced_before[end - 1] != forced_before[start]:
            return inf
        return price[end - 1] * (batches[end] - batches[start]) - (weighted[end] - weighted[start])

    layers = min(max_graphs, m)
    best = [inf] * (m + 1)  # best[end]: candidates[:end] in k runs, the last ending at end - 1
    for end in range(1, m + 1):
        best[end] = run_cost(0, end) if candidates[end - 1] <= limit else inf
    splits: list[list[int]] = [[0] * (m + 1)]
    finals = [best[m]]
    for k in range(2, layers + 1):
        best, split = _next_layer(best, k, m, run_cost)
        splits.append(split)
        finals.append(best[m])
        if progress is not None:
            progress(k, layers)
    return [Choice(k, _sizes_of(splits, k, m, candidates), finals[k - 1]) for k in range(fewest, layers + 1)]


def _next_layer(
    previous: list[float], k: int, m: int, run_cost: Callable[[int, int], float]
) -> tuple[list[float], list[int]]:
    """Layer ``k`` from layer ``k - 1``: for every end, the best start of the last run.

    The best start never moves left as the end moves right (the Monge property), so each middle
    end is searched only between its neighbours' best starts.
    """
    inf = float("inf")
    best = [inf] * (m + 1)
    split = [0] * (m + 1)
    stack = [(k, m, k - 1, m - 1)]  # ends lo..hi, starts from..to
    while stack:
        lo, hi, first, last = stack.pop()
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        top = min(mid - 1, last)
        value, where = inf, top  # no finite start (forced sizes not yet reachable): leave every start open
        for start in range(first, top + 1):
            candidate = previous[start] + run_cost(start, mid)
            if candidate < value:
                value, where = candidate, start
        best[mid], split[mid] = value, where
        stack.append((lo, mid - 1, first, where))
        stack.append((mid + 1, hi, where, last))
    return best, split


def _sizes_of(splits: list[list[int]], k: int, m: int, candidates: list[int]) -> tuple[int, ...]:
    """Walk the split points back from the last run: the largest member of every run."""
    chosen, end = [], m
    for layer in range(k, 0, -1):
        chosen.append(candidates[end - 1])
        end = splits[layer - 1][end]
    return tuple(reversed(chosen))
