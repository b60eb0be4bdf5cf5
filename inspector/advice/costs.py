"""What capture sizes cost at start-up, modelled from the graphs a run recorded.

Two figures a budget can bound, each fitted to what the data shows and described in words so the
advice can say what it assumed:

* capture time: seconds per capture size (every graph captured at that size, FULL and piecewise
  alike), the mean over the recorded sizes; a set of ``K`` sizes takes ``K`` times that.
* pool memory: one shared pool, captured largest first (``inspector.advice.memory``: the largest
  graph reserves its activations, each smaller one adds what it cannot reuse).

And a step cost per token count from measured step times, to weigh padding by what it costs
(``StepTimes``): the graph replay times a run recorded (``capture_core.step_time``), or a CSV.
"""

from __future__ import annotations

import bisect
import csv
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from inspector.advice.memory import MIB as MIB
from inspector.advice.memory import PoolForecast, RecordedPool


@dataclass(frozen=True)
class RecordedGraph:
    """One captured graph, as a run recorded it (in capture order within its run)."""

    captured_size: int
    capture_seconds: float
    pool_bytes: int
    run_id: int = 0


@dataclass(frozen=True)
class CostModel:
    """Capture time and pool memory of a set of capture sizes, fitted to recorded graphs."""

    seconds_per_size: float
    recorded_sizes: int
    pool: PoolForecast | None
    """The pool a list needs (``inspector.advice.memory``); None where no pool was recorded."""

    @classmethod
    def fit(cls, graphs: Iterable[RecordedGraph]) -> CostModel:
        graphs = list(graphs)
        seconds: dict[int, float] = defaultdict(float)
        for graph in graphs:
            seconds[graph.captured_size] += graph.capture_seconds
        if not seconds:
            raise ValueError("no recorded graphs to model capture costs from")
        pool = PoolForecast.fit(RecordedPool(g.run_id, g.captured_size, g.pool_bytes) for g in graphs)
        return cls(seconds_per_size=statistics.fmean(seconds.values()), recorded_sizes=len(seconds),
                   pool=pool)

    def capture_seconds(self, sizes: Sequence[int]) -> float:
        return self.seconds_per_size * len(sizes)

    def pool_bytes(self, sizes: Sequence[int]) -> float:
        return 0.0 if self.pool is None else self.pool.pool_bytes(sizes)

    def most_sizes(self, seconds: float) -> int:
        """The most capture sizes a capture-time budget allows (``ValueError`` when none fits)."""
        if seconds < self.seconds_per_size:
            raise ValueError(f"a capture-time budget of {seconds:g} s fits no graph: one capture size "
                             f"takes {self.seconds_per_size:.3g} s here")
        return int(seconds // self.seconds_per_size)

    def describe(self) -> list[str]:
        """The model in words, for the advice's output."""
        time = (f"capture time: {self.seconds_per_size:.3g} s per capture size (the mean of the "
                f"{self.recorded_sizes} recorded sizes, all their graphs)")
        if self.pool is None:
            return [time, "pool memory: none recorded (the eager backend has no graph pool), so a memory "
                          "budget bounds nothing"]
        return [time, self.pool.describe()]


@dataclass(frozen=True)
class StepTimes:
    """Measured step time by token count, for weighing padding by what it costs.

    Read from a CSV of ``size,seconds`` rows; between measured sizes the time is interpolated
    linearly, below the smallest it is the smallest's, above the largest it grows in proportion to
    the tokens. A measurement below a smaller size's is raised to it (a step's time does not fall
    as it grows; noise may say otherwise).
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def read(cls, path: str | Path) -> StepTimes:
        rows: list[tuple[int, float]] = []
        try:
            with open(path, newline="") as handle:
                for line, row in enumerate(csv.reader(handle), start=1):
                    if not row or row[0].strip().lower() in ("size", "captured_size"):
                        continue
                    try:
                        rows.append((int(row[0]), float(row[1])))
                    except (ValueError, IndexError):
                        got = ",".join(row)
                        raise ValueError(f"{path}: line {line}: expected size,seconds, got {got!r}") from None
        except OSError as error:
            raise ValueError(f"{path}: cannot read the step times: {error.strerror or error}") from None
        if not rows:
            raise ValueError(f"{path}: no step times (rows of size,seconds)")
        try:
            return cls.of(rows)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def of(cls, points: Iterable[tuple[int, float]]) -> StepTimes:
        """From ``(size, seconds)`` points, in any order (each size once)."""
        sizes: list[int] = []
        seconds: list[float] = []
        for size, value in sorted(points):
            if size < 1 or value < 0 or (sizes and size == sizes[-1]):
                raise ValueError("sizes must be positive and distinct, seconds not negative")
            sizes.append(size)
            seconds.append(max(value, seconds[-1]) if seconds else value)
        if not sizes:
            raise ValueError("no step times")
        return cls(tuple(sizes), tuple(seconds))

    def __call__(self, n: int) -> float:
        index = bisect.bisect_left(self.sizes, n)
        if index == 0:
            return self.seconds[0]
        if index == len(self.sizes):
            return self.seconds[-1] * n / self.sizes[-1]
        low, high = self.sizes[index - 1], self.sizes[index]
        share = (n - low) / (high - low)
        return self.seconds[index - 1] + share * (self.seconds[index] - self.seconds[index - 1])
