"""The read side (inspector.reading.queries and its in-memory rollup): appended rows are folded in once,
deletions rebuild it, its series stay bounded however long and many the runs, and run pickers stay
short."""

from __future__ import annotations

import time

from sqlalchemy import delete, func, select

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from inspector.reading.queries import Queries
from inspector.reading.rollup import Rollup, TimeBuckets
from inspector.reading.traffic import TrafficTotals
from inspector.recording.batch import ReplayDelta, TrafficWindow, graph_key
from inspector.storage.models import ReplayWindow, Run
from inspector.storage.store import Store
from inspector.storage.writer import KnownTotals, add_to_violation, append_traffic
from tests.support.sample import seed_sample


def add_window(store: Store, run_id: int, start: float, replays: int = 10) -> None:
    """What a recorder's next flush appends: one replay window of an 8-token graph, 7 real tokens each."""
    full, descriptor = CUDAGraphMode.FULL, BatchDescriptor(8, 8, True)
    delta = ReplayDelta(full, descriptor, replays=replays, num_real_tokens=7 * replays)
    window = TrafficWindow(start, start + 1, replays={graph_key(full, descriptor): delta})
    with store.writer() as conn:
        append_traffic(conn, run_id, [window], {}, KnownTotals.of_run(conn, run_id), start + 1)


def series_replays(queries: Queries, run_id: int | None = None) -> int:
    return sum(t.replays for _, t in queries.rollup.series(None if run_id is None else [run_id]))


def test_series_equal_the_windows_and_fold_only_new_rows(store: Store) -> None:
    ids = seed_sample(store, now=time.time())
    queries = Queries(store.engine)
    with store.engine.connect() as conn:
        total = conn.scalar(select(func.sum(ReplayWindow.replays)))
    queries.rollup.refresh()
    assert series_replays(queries) == total
    add_window(store, ids["eager_run"], time.time(), replays=1234)
    assert series_replays(queries) == total  # memoised until the next refresh
    queries.rollup.refresh()
    assert series_replays(queries) == total + 1234
    assert series_replays(queries, ids["eager_run"]) < total + 1234


def test_deleting_a_run_rebuilds_everything(store: Store) -> None:
    ids = seed_sample(store, now=time.time())
    queries = Queries(store.engine)
    assert queries.summary()["violations"]["findings"] == 3
    with store.engine.begin() as conn:
        conn.execute(delete(Run).where(Run.id == ids["cuda_run"]))
    summary = queries.summary()
    assert summary["violations"]["by_kind"] == {"address_drift": 1, "unexpected_capture": 1}
    with store.engine.connect() as conn:
        remaining = conn.scalar(select(func.sum(ReplayWindow.replays)))
    assert series_replays(queries) == remaining


def test_new_findings_count_but_repeats_do_not(store: Store) -> None:
    ids = seed_sample(store, now=time.time())
    queries = Queries(store.engine)
    assert queries.summary()["violations"]["findings"] == 3
    with store.writer() as conn:  # the same finding, seen 87 times more: its count grows, not its rows
        add_to_violation(conn, ids["drift"], 87, time.time())
    assert queries.summary()["violations"]["findings"] == 3
    assert queries.violation(ids["drift"])["count"] == 99


def test_with_concurrent_writers_rows_wait_until_their_ids_settle(store: Store) -> None:
    ids = seed_sample(store, now=time.time())
    now = [1000.0]
    rollup = Rollup(store.engine, settle_seconds=2.0, clock=lambda: now[0])
    rollup.refresh()
    assert rollup.series() == []  # nothing has been visible for two seconds yet
    now[0] += 2.5
    rollup.refresh()
    before = sum(t.replays for _, t in rollup.series())
    assert before > 0
    add_window(store, ids["eager_run"], time.time(), replays=77)
    rollup.refresh()  # the new id is seen now...
    assert sum(t.replays for _, t in rollup.series()) == before
    now[0] += 1.0
    rollup.refresh()  # ...one second later it may still have a lower id being written...
    assert sum(t.replays for _, t in rollup.series()) == before
    now[0] += 1.5
    rollup.refresh()  # ...two and a half seconds later everything below it has committed
    assert sum(t.replays for _, t in rollup.series()) == before + 77


def test_time_buckets_double_their_width_to_stay_bounded() -> None:
    buckets = TimeBuckets(max_buckets=16)
    for second in range(1000):
        buckets.bucket(1_700_000_000.0 + second).add(TrafficTotals(replays=1))
    assert len(buckets.buckets) <= 16
    assert buckets.width == 64.0
    assert sum(t.replays for t in buckets.buckets.values()) == 1000


def test_all_runs_together_stay_within_the_bucket_budget(store: Store) -> None:
    seed_sample(store, now=time.time())
    with store.engine.connect() as conn:
        total = conn.scalar(select(func.sum(ReplayWindow.replays)))
    rollup = Rollup(store.engine, total_buckets=40)
    rollup.refresh()
    assert rollup.buckets_held() <= 40
    assert sum(t.replays for _, t in rollup.series()) == total


def test_series_are_at_most_the_points_asked_for(store: Store) -> None:
    seed_sample(store, now=time.time())
    queries = Queries(store.engine)
    queries.rollup.refresh()
    points = queries.rollup.series(points=30)
    assert 0 < len(points) <= 31
    starts = [start for start, _ in points]
    assert starts == sorted(starts)


def test_traffic_ratios_are_none_before_any_traffic() -> None:
    assert TrafficTotals().hit_ratio is None and TrafficTotals().padding_waste is None
    assert TrafficTotals(replays=3, eager_batches=1).hit_ratio == 0.75
    assert TrafficTotals(num_real_tokens=3, padding_tokens=1).padding_waste == 0.25


def test_run_picker_lists_the_newest_runs_and_the_selected_one(store: Store) -> None:
    ids = seed_sample(store, now=time.time())
    queries = Queries(store.engine)
    assert [r["id"] for r in queries.run_options(limit=1)] == [ids["eager_run"]]
    with_selected = queries.run_options(ids["cuda_run"], limit=1)
    assert [r["id"] for r in with_selected] == [ids["eager_run"], ids["cuda_run"]]
    assert queries.live_run_ids() == [ids["eager_run"]]
    assert queries.live_run_ids(ids["cuda_run"]) == []
