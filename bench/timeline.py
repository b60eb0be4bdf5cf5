"""What ran at the same time on the GPU: kernel intervals from a profiler trace, and their overlap.

A graph replay is one launch to the host, but the profiler (CUPTI, through torch.profiler) still
reports every kernel and copy inside it with its start and end on the device clock. Two activities
can only be in flight together if they sit on different streams, so the time a communication
kernel spends under compute kernels is the overlap micro-batching bought, seen directly rather
than inferred from step times.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class Activity:
    """One kernel, copy or memset on the device: name, start and end in microseconds, bytes moved."""

    name: str
    start_us: float
    end_us: float
    category: str
    stream: int | None = None
    bytes: int | None = None


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (empty ones dropped)."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def total(intervals: Iterable[Interval]) -> float:
    """Time covered by ``intervals`` (overlaps counted once)."""
    return sum(end - start for start, end in merge(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Time covered by both ``a`` and ``b``: how long something of each was in flight together."""
    left, right = merge(a), merge(b)
    i = j = 0
    both = 0.0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if end > start:
            both += end - start
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return both


def concurrent_time(intervals: Sequence[Interval]) -> float:
    """Time during which at least two of ``intervals`` were in flight at once."""
    points = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    busy = 0.0
    depth = 0
    last = 0.0
    for when, step in points:
        if depth >= 2:
            busy += when - last
        depth += step
        last = when
    return busy


def read_chrome_trace(path: Path) -> list[Activity]:
    """The device activities of a ``torch.profiler`` chrome trace."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    activities = []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in GPU_CATEGORIES:
            continue
        start = float(event["ts"])
        args: dict[str, Any] = event.get("args") or {}
        activities.append(
            Activity(
                name=str(event.get("name", "")),
                start_us=start,
                end_us=start + float(event.get("dur", 0.0)),
                category=str(event["cat"]),
                stream=args.get("stream"),
                bytes=args.get("bytes"),
            )
        )
    return activities


@dataclass(frozen=True)
class OverlapSeen:
    """How much of the comm activities' time ran under compute, over one profiled window."""

    comm_us: float
    compute_us: float
    comm_under_compute_us: float
    any_concurrent_us: float
    comm_activities: int
    activities: int

    @property
    def comm_hidden_fraction(self) -> float | None:
        return self.comm_under_compute_us / self.comm_us if self.comm_us > 0 else None

    def per(self, replays: int) -> dict[str, float | int | None]:
        """The figures per replay (the window held ``replays`` of them), for JSON."""
        return {
            "comm_us": self.comm_us / replays,
            "compute_us": self.compute_us / replays,
            "comm_under_compute_us": self.comm_under_compute_us / replays,
            "any_concurrent_us": self.any_concurrent_us / replays,
            "comm_hidden_fraction": self.comm_hidden_fraction,
            "comm_activities_per_replay": self.comm_activities / replays,
            "activities_per_replay": self.activities / replays,
        }


def breakdown(activities: Sequence[Activity], replays: int, top: int = 12) -> list[dict[str, Any]]:
    """The activities by name, most device time first: count, microseconds and bytes per replay."""
    groups: dict[tuple[str, str], list[Activity]] = {}
    for activity in activities:
        groups.setdefault((activity.name, activity.category), []).append(activity)
    rows = [
        {
            "name": name,
            "category": category,
            "per_replay": len(group) / replays,
            "us_per_replay": sum(a.end_us - a.start_us for a in group) / replays,
            "bytes": sorted({a.bytes for a in group if a.bytes is not None}),
            "streams": sorted({a.stream for a in group if a.stream is not None}),
        }
        for (name, category), group in groups.items()
    ]
    rows.sort(key=lambda row: -row["us_per_replay"])
    return rows[:top]


def overlap_seen(activities: Sequence[Activity], is_comm: Callable[[Activity], bool]) -> OverlapSeen:
    """Split ``activities`` into comm (``is_comm``) and compute, and measure their overlap."""
    comm = [(a.start_us, a.end_us) for a in activities if is_comm(a)]
    compute = [(a.start_us, a.end_us) for a in activities if not is_comm(a)]
    return OverlapSeen(
        comm_us=total(comm),
        compute_us=total(compute),
        comm_under_compute_us=intersection(comm, compute),
        any_concurrent_us=concurrent_time([(a.start_us, a.end_us) for a in activities]),
        comm_activities=len(comm),
        activities=len(activities),
    )
