"""What capture sizes cost at start-up, modelled from the graphs a run recorded.

Two figures a budget can bound, each fitted to what the data shows and described in words so the
advice can say what it assumed:

* capture time: seconds per capture size (every graph captured at that size, FULL and piecewise
  alike), the mean over the recorded sizes; a set of ``K`` sizes takes ``K`` times that.
* pool memory: one shared pool, captured largest first, so the largest graph grows it and smaller
  ones mostly reuse its blocks. The model: the recorded largest size's growth, scaled by the new
  largest size (activations grow with the token count), plus the median growth of a smaller
  size for every other size.

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

MIB = 2**20


@dataclass(frozen=True)
class RecordedGraph:
    """One captured graph, as a run recorded it."""

    captured_size: int
    capture_seconds: float
    pool_bytes: int


@dataclass(frozen=True)
class CostModel:
    """Capture time and pool memory of a set of capture sizes, fitted to recorded graphs."""

    seconds_per_size: float
    largest_size: int
    largest_pool_bytes: int
    pool_bytes_per_other_size: float
    recorded_sizes: int

    @classmethod
    def fit(cls, graphs: Iterable[RecordedGraph]) -> CostModel:
        seconds: dict[int, float] = defaultdict(float)
        pool: dict[int, int] = defaultdict(int)
        for graph in graphs:
            seconds[graph.captured_size] += graph.capture_seconds
            pool[graph.captured_size] += graph.pool_bytes
        if not seconds:
            raise ValueError("no recorded graphs to model capture costs from")
        largest = max(pool)
        others = [pool[size] for size in pool if size != largest]
        return cls(
            seconds_per_size=statistics.fmean(seconds.values()),
            largest_size=largest,
            largest_pool_bytes=pool[largest],
            pool_bytes_per_other_size=statistics.median(others) if others else 0.0,
            recorded_sizes=len(seconds),
        )

    def capture_seconds(self, sizes: Sequence[int]) -> float:
        return self.seconds_per_size * len(sizes)

    def pool_bytes(self, sizes: Sequence[int]) -> float:
        largest = self.largest_pool_bytes * max(sizes) / self.largest_size
        return largest + self.pool_bytes_per_other_size * (len(sizes) - 1)

    def most_sizes(self, max_size: int, seconds: float | None, memory_bytes: float | None) -> int | None:
        """The most capture sizes (the largest being ``max_size``) the budgets allow; None: unbounded.

        Raises ``ValueError`` when not even ``max_size`` alone fits.
        """
        bounds = []
        if seconds is not None:
            if seconds < self.seconds_per_size:
                raise ValueError(f"a capture-time budget of {seconds:g} s fits no graph: one capture size "
                                 f"takes {self.seconds_per_size:.3g} s here")
            bounds.append(int(seconds // self.seconds_per_size))
        if memory_bytes is not None:
            alone = self.pool_bytes([max_size])
            if memory_bytes < alone:
                raise ValueError(f"a memory budget of {memory_bytes / MIB:g} MiB fits no graph: the largest "
                                 f"size, {max_size}, alone needs {alone / MIB:.1f} MiB of pool")
            if self.pool_bytes_per_other_size > 0:
                bounds.append(1 + int((memory_bytes - alone) // self.pool_bytes_per_other_size))
        return min(bounds) if bounds else None

    def describe(self) -> list[str]:
        """The model in words, for the advice's output."""
        time = (f"capture time: {self.seconds_per_size:.3g} s per capture size (the mean of the "
                f"{self.recorded_sizes} recorded sizes, all their graphs)")
        if not self.largest_pool_bytes and not self.pool_bytes_per_other_size:
            return [time, "pool memory: none recorded (the eager backend has no graph pool), so a memory "
                          "budget bounds nothing"]
        return [
            time,
            f"pool memory: one shared pool, so it grows with the largest graph: "
            f"{self.largest_pool_bytes / MIB:.1f} MiB at {self.largest_size} tokens, scaled by the "
            f"largest size, plus {self.pool_bytes_per_other_size / MIB:.2f} MiB (the median) per other size",
        ]


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
