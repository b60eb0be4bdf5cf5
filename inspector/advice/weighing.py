"""How the advice weighs padding: by step time where it is known, else by tokens, and saying which.

A padding token costs what a step at the padded size costs more than a step at the real size. Where
runs recorded step times of real graphs (``capture_core.step_time``: sampled replays timed per
captured size with CUDA events), the step cost of a size is the mean replay time there, interpolated
between the recorded sizes (``costs.StepTimes``); a CSV of measured times (``--step-times``) stands in
for them; with neither (the eager backend's host-clock times are of the model re-run, not of a
graph), padding is counted in tokens, and the advice says so.

With step times the advice also keeps a lone request fast: the best step a batch of one token can
have is a graph of size 1 (the cost curve's value at 1); the smallest advised size is held to one
whose step is within ``slack`` of that (``LoneRequest``), so that a request alone at low load never
pads to a size that costs it more than that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inspector.advice.costs import StepTimes
from inspector.advice.sizes import Histogram, StepCost, tokens

CUDA_EVENTS = "cuda_events"
"""The clock of a real graph's timed replays (``capture_core.step_time.CUDA_EVENTS``, named here so
that reading a database needs no torch)."""
LONE_REQUEST_SLACK = 0.05
"""A lone request's step may be this much slower than its best possible step (5%)."""


@dataclass(frozen=True)
class Weighing:
    """The step cost padding is weighed by, and what it is."""

    cost: StepCost
    says: str
    """In words, for the advice's output: what the cost is and where it came from."""
    by_time: bool
    eager_seconds: tuple[tuple[int, float], ...] = ()
    """(size, mean eager step time) where runs recorded one (for the lone request's best step)."""
    eager: StepTimes | None = None
    """Eager step time by size, interpolated between those (for the batches a set leaves eager)."""

    def eager_at(self, size: int) -> float | None:
        return dict(self.eager_seconds).get(size)

    @classmethod
    def by_tokens(cls, why: str) -> Weighing:
        return cls(tokens, f"padding counted in tokens: {why}", by_time=False)

    @classmethod
    def from_csv(cls, times: StepTimes, path: str) -> Weighing:
        says = f"padding weighed by the step times in {path} ({len(times.sizes)} sizes)"
        return cls(times, says, by_time=True)


@dataclass(frozen=True)
class RecordedStepTime:
    """The step times runs recorded at one size: graph replays and eager steps (sums and counts)."""

    size: int
    graph_seconds: float
    graph_samples: int
    eager_seconds: float
    eager_samples: int


def recorded_weighing(points: Sequence[RecordedStepTime], clocks: Sequence[str]) -> Weighing:
    """Padding weighed by the recorded replay times of real graphs (pooled: the mean over every timed
    replay at a size; ``points`` hold the CUDA-event times alone where there are any), or by tokens,
    saying why: no replay was timed, or only the eager backend's, whose "replay" re-runs the model on
    the host clock (no graph's time, and padding advice is for graphs)."""
    graph = [(p.size, p.graph_seconds / p.graph_samples) for p in points if p.graph_samples]
    if not graph:
        return Weighing.by_tokens("no replay was timed in these runs (step timing needs the checks on, and "
                                  "samples replays; or feed on_step_time)")
    if CUDA_EVENTS not in clocks:
        return Weighing.by_tokens("the only step times recorded are the eager backend's (its replays re-run "
                                  "the model on the host clock: no graph was timed)")
    samples = sum(p.graph_samples for p in points)
    eager = tuple((p.size, p.eager_seconds / p.eager_samples) for p in points if p.eager_samples)
    eager_curve = StepTimes.of(eager) if eager else None
    says = (f"padding weighed by the recorded step times: graph replays timed at {len(graph)} sizes "
            f"({samples:,} timed replays, {CUDA_EVENTS}), interpolated between them")
    if len(set(clocks)) > 1:
        says += "; the eager backend's host-clock times left out (of the model re-run, not of a graph)"
    return Weighing(StepTimes.of(graph), says, by_time=True, eager_seconds=eager, eager=eager_curve)


@dataclass(frozen=True)
class LoneRequest:
    """What a batch of one token costs with the advised sizes, against the best it could cost."""

    best_seconds: float
    """The step cost at size 1: a graph of that size (the curve is flat below its smallest size)."""
    limit: int
    """The largest size whose step is within ``slack`` of the best."""
    slack: float
    held: bool
    """The smallest size was held at or below ``limit`` (False: no batch that small was seen, or every
    size is within the slack)."""
    advised_size: int
    advised_seconds: float
    eager_seconds: float | None
    """A lone request run eagerly, where recorded (faster than any graph of it, sometimes)."""

    @property
    def over_best(self) -> float:
        """How much slower than its best a lone request's step is with the advised sizes (0.03: 3%)."""
        return self.advised_seconds / self.best_seconds - 1 if self.best_seconds > 0 else 0.0

    def describe(self) -> str:
        if self.held:
            why = f"held within {100 * self.slack:g}%: the smallest size is at most {self.limit}"
        else:
            why = (f"sizes up to {self.limit} are within {100 * self.slack:g}%; no batch that small was "
                   "seen, so the smallest size was left free")
        text = (f"a lone request pads to {self.advised_size}: {self.advised_seconds * 1e3:.3f} ms a step, "
                f"{100 * self.over_best:.1f}% over its best ({self.best_seconds * 1e3:.3f} ms at size 1; "
                f"{why})")
        if self.eager_seconds is not None and self.eager_seconds < self.best_seconds:
            text += f"; run eagerly it took {self.eager_seconds * 1e3:.3f} ms, less than any graph of it"
        return text


def lone_request_limit(cost: StepCost, top: int, slack: float) -> tuple[float, int]:
    """The best step of a lone request (the cost at 1) and the largest size up to ``top`` whose step
    costs at most ``1 + slack`` times that (the cost never falls as the size grows: a bisection)."""
    best = cost(1)
    bound = best * (1 + slack)
    low, high = 1, top
    while low < high:
        middle = (low + high + 1) // 2
        if cost(middle) <= bound:
            low = middle
        else:
            high = middle - 1
    return best, low


def lone_request(weighing: Weighing, sizes: Sequence[int], best: float, limit: int, slack: float,
                 held: bool) -> LoneRequest:
    advised = min(sizes)
    return LoneRequest(best, limit, slack, held, advised, weighing.cost(advised), weighing.eager_at(1))


def modelled_seconds(histogram: Histogram, sizes: Sequence[int], weighing: Weighing) -> float | None:
    """The step time of every batch by the model, summed: a replayed batch at its padded size's
    graph time, one above the largest size at the eager time of its own size. None when some batch
    runs eagerly and no eager time is known."""
    table = sorted(set(sizes))
    total, index = 0.0, 0
    for size, batches in zip(histogram.sizes, histogram.batches, strict=True):
        while index < len(table) and table[index] < size:
            index += 1
        if index < len(table):
            total += batches * weighing.cost(table[index])
        elif weighing.eager is None:
            return None
        else:
            total += batches * weighing.eager(size)
    return total
