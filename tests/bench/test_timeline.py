"""The interval arithmetic that turns a profiler trace into "how much comm ran under compute"."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from bench.timeline import (
    Activity,
    breakdown,
    concurrent_time,
    intersection,
    merge,
    overlap_seen,
    read_chrome_trace,
    total,
)

intervals = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 50)).map(lambda p: (float(p[0]), float(p[0] + p[1]))),
    max_size=12,
)


def covered(spans: list[tuple[float, float]]) -> set[int]:
    """The unit cells [t, t+1) the spans cover: a brute-force reference for integer intervals."""
    return {t for start, end in spans for t in range(int(start), int(end))}


def test_merge_joins_touching_and_overlapping_intervals_and_drops_empty_ones() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert total([(0, 10), (2, 3), (8, 12)]) == 12


@given(intervals, intervals)
def test_intersection_and_total_agree_with_counting_cells(a, b) -> None:
    assert total(a) == len(covered(a))
    assert intersection(a, b) == len(covered(a) & covered(b))
    assert intersection(a, b) == intersection(b, a) <= min(total(a), total(b))


@given(intervals)
def test_concurrent_time_counts_cells_covered_twice(spans) -> None:
    depth: dict[int, int] = {}
    for start, end in spans:
        for t in range(int(start), int(end)):
            depth[t] = depth.get(t, 0) + 1
    assert concurrent_time(spans) == sum(1 for d in depth.values() if d >= 2)


def test_overlap_seen_splits_comm_from_compute() -> None:
    # Compute on one stream back to back; two comm kernels, one fully under compute, one half.
    activities = [
        Activity("gemm", 0, 100, "kernel"),
        Activity("gemm", 100, 200, "kernel"),
        Activity("spin_kernel", 50, 90, "kernel"),
        Activity("spin_kernel", 180, 220, "kernel"),
    ]
    seen = overlap_seen(activities, lambda a: a.name == "spin_kernel")
    assert (seen.comm_us, seen.compute_us, seen.comm_under_compute_us) == (80, 200, 60)
    assert seen.comm_hidden_fraction == 0.75
    assert seen.any_concurrent_us == 60
    per = seen.per(2)
    assert per["comm_us"] == 40 and per["comm_activities_per_replay"] == 1
    assert per["comm_hidden_fraction"] == 0.75
    nothing = overlap_seen(activities, lambda a: False)
    assert nothing.comm_us == 0 and nothing.comm_hidden_fraction is None


def test_read_chrome_trace_keeps_device_activities_only(tmp_path: Path) -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 5},
            {"ph": "X", "cat": "kernel", "name": "spin_kernel", "ts": 10.5, "dur": 4, "args": {"stream": 7}},
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoD",
                "ts": 12,
                "dur": 2,
                "args": {"bytes": 64},
            },
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert read_chrome_trace(path) == [
        Activity("spin_kernel", 10.5, 14.5, "kernel", stream=7),
        Activity("Memcpy DtoD", 12.0, 14.0, "gpu_memcpy", bytes=64),
    ]


def test_breakdown_groups_activities_by_name_most_time_first() -> None:
    activities = [
        Activity("gemm", 0, 30, "kernel", stream=7),
        Activity("Memcpy DtoD", 30, 31, "gpu_memcpy", stream=7, bytes=64),
        Activity("gemm", 40, 70, "kernel", stream=7),
        Activity("Memcpy DtoD", 70, 72, "gpu_memcpy", stream=9, bytes=128),
    ]
    rows = breakdown(activities, replays=2)
    assert [(r["name"], r["per_replay"], r["us_per_replay"]) for r in rows] == [
        ("gemm", 1.0, 30.0),
        ("Memcpy DtoD", 1.0, 1.5),
    ]
    assert rows[1]["bytes"] == [64, 128] and rows[1]["streams"] == [7, 9]
    assert breakdown(activities, replays=1, top=1)[0]["name"] == "gemm"
