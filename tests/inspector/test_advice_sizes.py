"""The capture-size optimiser against brute force: optimal for every graph count, on any histogram."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inspector.advice.sizes import Histogram, best_choices, project, tokens

histograms = st.dictionaries(st.integers(1, 40), st.integers(1, 50), min_size=1, max_size=9).map(
    Histogram.from_counts
)


def padding_cost(histogram: Histogram, sizes: tuple[int, ...], max_size: int, cost=tokens) -> float:
    """What the optimiser minimises, spelled out: each batch at or under max_size pays cost(pad) - cost(n)."""
    total = 0.0
    for n, batches in zip(histogram.sizes, histogram.batches, strict=True):
        if n <= max_size:
            total += batches * (cost(min(s for s in sizes if s >= n)) - cost(n))
    return total


def brute_force(histogram: Histogram, max_size: int, graphs: int, pool: list[int], cost=tokens) -> float:
    """The least cost over every set of at most ``graphs`` sizes from ``pool`` that holds max_size."""
    others = [s for s in pool if s < max_size]
    best = math.inf
    for k in range(graphs):
        for rest in itertools.combinations(others, k):
            best = min(best, padding_cost(histogram, (*rest, max_size), max_size, cost))
    return best


@settings(max_examples=150, deadline=None)
@given(histogram=histograms, extra=st.integers(0, 6), max_graphs=st.integers(1, 7))
def test_every_graph_count_gets_the_least_padding_brute_force_finds(histogram, extra, max_graphs) -> None:
    max_size = histogram.largest + extra
    choices = best_choices(histogram, max_size, max_graphs)
    candidates = sorted({*histogram.sizes, max_size})
    assert [c.graphs for c in choices] == list(range(1, min(max_graphs, len(candidates)) + 1))
    for choice in choices:
        assert len(choice.sizes) == choice.graphs and choice.sizes[-1] == max_size
        assert list(choice.sizes) == sorted(set(choice.sizes))
        assert padding_cost(histogram, choice.sizes, max_size) == choice.cost
        assert choice.cost == brute_force(histogram, max_size, choice.graphs, candidates)
        assert project(histogram, choice.sizes).traffic.padding_tokens == choice.cost
    costs = [c.cost for c in choices]
    assert costs == sorted(costs, reverse=True), "one more graph never pads more"


@settings(max_examples=40, deadline=None)
@given(histogram=st.dictionaries(st.integers(1, 12), st.integers(1, 9), min_size=1, max_size=6)
       .map(Histogram.from_counts), max_graphs=st.integers(1, 4))
def test_sizes_nobody_asked_for_never_beat_the_observed_ones(histogram, max_graphs) -> None:
    """Searching every integer size up to max_size finds nothing better than the observed sizes."""
    max_size = histogram.largest
    for choice in best_choices(histogram, max_size, max_graphs):
        assert choice.cost == brute_force(histogram, max_size, choice.graphs, list(range(1, max_size + 1)))


@settings(max_examples=60, deadline=None)
@given(histogram=histograms, max_graphs=st.integers(1, 6),
       steps=st.lists(st.floats(0, 10), min_size=41, max_size=41))
def test_padding_weighed_by_step_cost_is_optimal_too(histogram, max_graphs, steps) -> None:
    levels = list(itertools.accumulate(steps))  # any non-decreasing step cost

    def cost(n: int) -> float:
        return levels[n]

    max_size = histogram.largest
    candidates = sorted(histogram.sizes)
    for choice in best_choices(histogram, max_size, max_graphs, step_cost=cost):
        expected = brute_force(histogram, max_size, choice.graphs, candidates, cost)
        assert choice.cost == pytest.approx(expected, abs=1e-6)
        assert padding_cost(histogram, choice.sizes, max_size, cost) == pytest.approx(choice.cost, abs=1e-6)


def test_batches_above_max_size_are_left_to_run_eagerly() -> None:
    histogram = Histogram.from_counts({3: 10, 8: 5, 300: 2})
    (one, two) = best_choices(histogram, 8, 2)
    assert one.sizes == (8,) and one.cost == 10 * 5
    assert two.sizes == (3, 8) and two.cost == 0
    projected = project(histogram, two.sizes).traffic
    assert (projected.replays, projected.eager_batches, projected.padding_tokens) == (15, 2, 0)
    assert projected.hit_ratio == 15 / 17 and projected.padding_waste == 0


def test_degenerate_histograms() -> None:
    single = Histogram.of([5, 5, 5])
    assert [(c.sizes, c.cost) for c in best_choices(single, 5, 4)] == [((5,), 0)], "one size, one graph"
    below = best_choices(single, 9, 3)
    assert [(c.sizes, c.cost) for c in below] == [((9,), 12), ((5, 9), 0)], "max_size above every batch"
    nothing_under = best_choices(Histogram.of([50]), 8, 2)
    assert [(c.sizes, c.cost) for c in nothing_under] == [((8,), 0)], "every batch runs eagerly anyway"


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        Histogram.from_counts({0: 3})
    with pytest.raises(ValueError, match="ascending"):
        Histogram((4, 2), (1, 1))
    with pytest.raises(ValueError, match="max_size and max_graphs must be positive"):
        best_choices(Histogram.of([3]), 0, 1)
    with pytest.raises(ValueError, match="must not fall"):
        best_choices(Histogram.of([1, 2, 3]), 3, 2, step_cost=lambda n: -n)


@settings(max_examples=150, deadline=None)
@given(histogram=histograms, forced=st.sets(st.integers(1, 45), max_size=3), extra=st.integers(0, 5),
       max_graphs=st.integers(1, 7), steps=st.lists(st.floats(0, 10), min_size=51, max_size=51))
def test_forced_sizes_are_in_every_set_and_the_rest_is_still_optimal(
    histogram, forced, extra, max_graphs, steps
) -> None:
    levels = list(itertools.accumulate(steps))
    max_size = histogram.largest + extra
    kept = {s for s in forced if s < max_size}
    if max_graphs < len(kept) + 1:
        with pytest.raises(ValueError, match=r"forced size\(s\) and the largest size need"):
            best_choices(histogram, max_size, max_graphs, forced=forced)
        return
    choices = best_choices(histogram, max_size, max_graphs, step_cost=levels.__getitem__, forced=forced)
    candidates = sorted({*histogram.sizes, *kept, max_size} - {s for s in histogram.sizes if s > max_size})
    assert choices[0].graphs == len(kept) + 1
    for choice in choices:
        assert kept <= set(choice.sizes) and choice.sizes[-1] == max_size
        assert len(choice.sizes) == choice.graphs
        others = [s for s in candidates if s not in kept and s != max_size]
        best = min(
            padding_cost(histogram, tuple(sorted({*rest, *kept, max_size})), max_size, levels.__getitem__)
            for k in range(choice.graphs - len(kept))
            for rest in itertools.combinations(others, k)
        )
        assert choice.cost == pytest.approx(best, abs=1e-6)


@settings(max_examples=120, deadline=None)
@given(histogram=histograms, limit=st.integers(1, 40), max_graphs=st.integers(1, 6))
def test_the_smallest_size_can_be_held_down_and_the_rest_is_still_optimal(histogram, limit, max_graphs):
    max_size = histogram.largest
    if limit < histogram.sizes[0]:
        with pytest.raises(ValueError, match="no candidate size is at or below"):
            best_choices(histogram, max_size, max_graphs, smallest_at_most=limit)
        return
    needed = 1 if limit >= max_size else 2
    if max_graphs < needed:
        with pytest.raises(ValueError, match=f"a size at or below {limit} and the largest size need 2"):
            best_choices(histogram, max_size, max_graphs, smallest_at_most=limit)
        return
    choices = best_choices(histogram, max_size, max_graphs, smallest_at_most=limit)
    assert choices[0].graphs == needed
    candidates = sorted(histogram.sizes)
    for choice in choices:
        assert choice.sizes[0] <= limit and choice.sizes[-1] == max_size
        best = min(
            padding_cost(histogram, (*rest, max_size), max_size)
            for k in range(choice.graphs)
            for rest in itertools.combinations([s for s in candidates if s < max_size], k)
            if (rest or (max_size,))[0] <= limit
        )
        assert choice.cost == best
