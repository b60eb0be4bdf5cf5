"""The graph pool a list of capture sizes needs, forecast from the pool bytes runs recorded.

Every graph of a runtime is captured into one shared pool, the largest size first. The first capture
grows the pool by all its graph needs at once: what its outputs keep (they live on as the graph's
static outputs) and its activations, freed at the end of the capture but reserved in the pool. Each
smaller graph then reuses those freed blocks for its own activations and adds only what it cannot
reuse: mostly its own outputs. So a run's record reads: the largest size's pool bytes (the *base*),
then an *extra* per smaller size.

The forecast for a proposed list, largest ``m`` first: ``base(m) + sum(extra(s) for the others)``.
The extras are the recorded ones, by size, each taken as the median of it and its neighbours (up to
two recorded sizes on either side, as many on each), interpolated between recorded sizes (linearly
extrapolated beyond them: outputs grow with the tokens); the base of a size is its extra plus the
activations, which grow in proportion to the tokens: the recorded base less the extra there, per
token, times ``m``. Several runs pool their figures (the median per size).

Why the neighbours' median: the caching allocator grows a pool in segments, and now and then a
capture that finds no free block large enough reserves a whole new segment, which the captures after
it then fill. That jump lands on whichever size asked first, and whether it comes at all depends on the
whole list: on the H200 a 35-size run of the small reference decoder recorded 192 MiB at size 192
(once the static outputs of the eight larger graphs had filled the blocks the largest one freed) and
0-2 MiB at the others; the same list captured again jumped again, while lists of 9 and 16 of those
sizes reserved no more than the largest size alone. A single size's jump is passed over, which
forecasts such shorter lists (the advised ones) and under-forecasts a long list that jumps; extras
that grow with the size, as outputs do, come through unchanged (the median of evenly spaced points on
a line is the middle one).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class RecordedPool:
    """One graph's share of its run's pool, in capture order."""

    run_id: int
    captured_size: int
    pool_bytes: int


@dataclass(frozen=True)
class PoolForecast:
    """The pool a list of sizes needs, fitted to what runs recorded (see the module)."""

    extras: tuple[tuple[int, float], ...]
    """(size, bytes a graph of that size adds to a pool a larger graph made), ascending."""
    activations_per_token: float
    """What the largest graph's capture reserves beyond its own extra, per token of its size."""
    recorded_bases: tuple[tuple[int, float], ...]
    """(each run's largest size, its pool bytes): what the activation figure comes from."""

    @classmethod
    def fit(cls, graphs: Iterable[RecordedPool]) -> PoolForecast | None:
        """None when nothing was recorded, or no pool (the eager backend has none)."""
        runs: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for graph in graphs:
            runs[graph.run_id][graph.captured_size] += graph.pool_bytes
        if not runs or not any(b for sizes in runs.values() for b in sizes.values()):
            return None
        extras: dict[int, list[int]] = defaultdict(list)
        bases = []
        for sizes in runs.values():
            largest = max(sizes)
            bases.append((largest, float(sizes[largest])))
            for size, pool in sizes.items():
                if size != largest:
                    extras[size].append(pool)
        medians = sorted((size, float(statistics.median(pools))) for size, pools in extras.items())
        points = _neighbours_median(medians)
        partial = cls(points, 0.0, tuple(sorted(bases)))
        per_token = statistics.median(max(0.0, base - partial.extra(size)) / size for size, base in bases)
        return cls(points, per_token, tuple(sorted(bases)))

    def extra(self, size: int) -> float:
        """What a graph of ``size`` adds to a pool a larger graph made (interpolated)."""
        points = self.extras
        if not points:
            return 0.0
        sizes = [s for s, _ in points]
        index = bisect.bisect_left(sizes, size)
        if index < len(points) and sizes[index] == size:
            return points[index][1]
        if len(points) == 1:
            return points[0][1]
        if 0 < index < len(points):
            (low, low_b), (high, high_b) = points[index - 1], points[index]
            return low_b + (size - low) / (high - low) * (high_b - low_b)
        slope, intercept = _line(points)
        return max(0.0, intercept + slope * size)

    def base(self, size: int) -> float:
        """The pool a graph of ``size`` makes when it is the largest (captured first)."""
        return self.extra(size) + self.activations_per_token * size

    def pool_bytes(self, sizes: Sequence[int]) -> float:
        """The pool ``sizes`` need, captured largest first into one pool."""
        if not sizes:
            return 0.0
        ordered = sorted(set(sizes))
        return self.base(ordered[-1]) + sum(self.extra(size) for size in ordered[:-1])

    def describe(self) -> str:
        largest, base = self.recorded_bases[-1]
        low = min((b for _, b in self.extras), default=0.0)
        high = max((b for _, b in self.extras), default=0.0)
        per_token = self.activations_per_token / MIB * 1024
        return (f"pool memory: one shared pool, captured largest first: the largest graph reserves its "
                f"activations ({per_token:.1f} KiB a token; {base / MIB:.1f} MiB recorded at {largest} "
                f"tokens), each smaller one adds what it cannot reuse ({low / MIB:.2f}..{high / MIB:.2f} "
                "MiB per size: the median of its and its neighbours' records, interpolated between sizes)")


def _neighbours_median(points: Sequence[tuple[int, float]], reach: int = 2) -> tuple[tuple[int, float], ...]:
    """Each point's value as the median of it and up to ``reach`` neighbours on either side (as many
    on each side, so the ends keep their own values): one size's segment jump is passed over."""
    values = [v for _, v in points]
    smoothed = []
    for index, (size, _) in enumerate(points):
        side = min(reach, index, len(points) - 1 - index)
        smoothed.append((size, float(statistics.median(values[index - side:index + side + 1]))))
    return tuple(smoothed)


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept through ``points``."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = 0.0 if not spread else sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


def vllm_gpu_memory_utilization(current: float, pool_now: float, pool_new: float, total_bytes: float
                                ) -> float:
    """The ``--gpu-memory-utilization`` that keeps vLLM's KV cache as it is when its CUDA-graph pool
    goes from ``pool_now`` to ``pool_new`` bytes: vLLM (0.21 on) profiles its graphs' memory and takes
    it from that share before the KV cache, so the share moves by the difference over the GPU's
    memory."""
    return current + (pool_new - pool_now) / total_bytes
