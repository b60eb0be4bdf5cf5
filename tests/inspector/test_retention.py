"""Retention folds old traffic windows into coarser ones and changes no figure: every sum of the
windows, every running total, the overview, /metrics and the report read the same before and
after, on SQLite and PostgreSQL; the daemon's rollup keeps its totals across a fold (and rebuilds
when a fold took rows it had not read); `db prune` and `serve --retain` run it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, event, func, select, update
from workers import FULL, PIECEWISE, capture, fetch_rows

from capture_core.descriptor import BatchDescriptor
from dashboard.cli import main
from inspector.gating.report import build_report, render_json
from inspector.ranks.steps import StepSegment, stretches
from inspector.reading.metrics import InspectorCollector
from inspector.reading.queries import Queries
from inspector.recording.batch import ReplayDelta, TrafficWindow, graph_key
from inspector.storage import retention
from inspector.storage.models import (
    BatchSizeCount,
    EagerFallback,
    EagerTotal,
    ReplayTotal,
    ReplayWindow,
    StepSequence,
    WindowFold,
)
from inspector.storage.retention import Policy, Tier, describe_duration, parse_duration, prune
from inspector.storage.store import Store, open_store
from inspector.storage.writer import (
    KnownTotals,
    RunInfo,
    append_steps,
    append_traffic,
    insert_graphs,
    insert_run,
)
from tests.support.daemon import Daemon
from tests.support.fleet import Fleet, start_fleet, write_hour
from tests.support.installed import Program

HOURS = 3
NOW = 1_800_000_000.0
"""A multiple of every grain below, so the expected row counts are exact."""
POLICY = Policy((Tier.parse("1h:1m"), Tier.parse("2h:10m")))
KEYS = ((FULL, BatchDescriptor(4, 4, True)), (FULL, BatchDescriptor(8, 8, True)),
        (PIECEWISE, BatchDescriptor(16)))


def _windows(start: float, seconds: int) -> Iterator[TrafficWindow]:
    """One flush a second: three graphs, an eager batch every 7 s, two batch sizes."""
    for i in range(seconds):
        t = start + i
        window = TrafficWindow(t, t + 1.0)
        for n, (mode, descriptor) in enumerate(KEYS):
            if (i + n) % 5:  # each graph idle one window in five
                window.replays[graph_key(mode, descriptor)] = ReplayDelta(mode, descriptor, 3 + n, 2 + i % 3)
        if i % 7 == 0:
            window.eager[("above_max_capture_size", "full")] = [1, 300]
        window.batch_sizes = {1 + i % 3: 2, 9: 1}
        yield window


def _record(store: Store, runs: int = 2, start: float = NOW - HOURS * 3600, seconds: int = HOURS * 3600
            ) -> None:
    """``runs`` runs of ``seconds`` one-second windows, written as recorders write them."""
    for rank in range(runs):
        with store.writer() as conn:
            info = RunInfo(f"rank {rank}", "node", 100 + rank, "engine", rank, runs, "cpu", "{}", start - 1)
            run_id = insert_run(conn, info, start)
            # The third graph key has no graph row: its windows' graph_id is NULL.
            ids = insert_graphs(conn, run_id, [capture(d, mode=m) for m, d in KEYS[:2]])
        known = KnownTotals()
        windows = list(_windows(start, seconds))
        for first in range(0, len(windows), 2000):
            with store.writer() as conn:
                known.update(append_traffic(conn, run_id, windows[first:first + 2000], ids, known, start))


def _sums(store: Store) -> dict[str, Any]:
    """Every sum a reader could take over the traffic tables, and the running totals."""
    w, e, b = ReplayWindow, EagerFallback, BatchSizeCount
    key = (w.run_id, w.mode, w.descriptor_key, w.graph_id, w.captured_size, w.num_reqs, w.uniform)
    queries = {
        "replays": select(*key, func.sum(w.replays), func.sum(w.num_real_tokens), func.sum(w.padding_tokens),
                          func.sum(w.windows), func.min(w.window_start), func.max(w.window_end))
        .group_by(*key).order_by(w.run_id, w.mode, w.descriptor_key),
        "eager": select(e.run_id, e.reason, e.mode, func.sum(e.batches), func.sum(e.num_real_tokens),
                        func.sum(e.windows))
        .group_by(e.run_id, e.reason, e.mode).order_by(e.run_id, e.reason),
        "sizes": select(b.run_id, b.num_real_tokens, func.sum(b.batches))
        .group_by(b.run_id, b.num_real_tokens).order_by(b.run_id, b.num_real_tokens),
        "replay_totals": ReplayTotal.__table__.select().order_by(ReplayTotal.id),
        "eager_totals": EagerTotal.__table__.select().order_by(EagerTotal.id),
    }
    with store.engine.connect() as conn:
        return {name: [tuple(row) for row in conn.execute(query)] for name, query in queries.items()}


def _queries(store: Store) -> Queries:
    queries = Queries(store.engine)
    queries.rollup.settle_seconds = 0.0  # one test process writes: no commit is ever in flight
    return queries


def _readers(store: Store, queries: Queries | None = None) -> dict[str, Any]:
    """What the overview, /metrics and the report say; the time series as its totals."""
    summary = (queries or _queries(store)).summary()
    series = summary["charts"].pop("series")
    summary["runs"].pop("live")
    registry = CollectorRegistry()
    registry.register(InspectorCollector(store))
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect()
               for s in f.samples if f.name != "graph_inspector_scrape_duration_seconds"}
    report = [line for line in render_json(build_report(store)).splitlines() if '"generated_at"' not in line]
    over_time = (sum(p["replays"] for p in series), sum(p["eager_batches"] for p in series))
    return {"summary": summary, "metrics": metrics, "report": report, "series_totals": over_time}


def _rows(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {m.__tablename__: conn.scalar(select(func.count()).select_from(m))
                for m in (ReplayWindow, EagerFallback, BatchSizeCount)}


def test_durations_and_tiers_parse_and_say_what_is_wrong() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "30m", "12h", "7d", "2w", "1.5h")] == [
        90, 90, 1800, 43200, 604800, 1209600, 5400]
    assert describe_duration(604800) == "1w" and describe_duration(5400) == "90m"
    assert Tier.parse("7d") == Tier(604800, 3600) and str(POLICY) == (
        "older than 1h into 1m windows, older than 2h into 10m windows")
    for bad in ("", "7x", "-1h", "0", "h"):
        with pytest.raises(ValueError, match="expected a positive duration"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="must be coarser"):
        Policy((Tier.parse("1h:1h"), Tier.parse("1d:1m")))


def test_folding_keeps_every_total_and_is_done_once(db_url: str) -> None:
    store = open_store(db_url)
    try:
        _record(store)
        before_rows, before, readers = _rows(store), _sums(store), _readers(store)
        report = prune(store, POLICY, now=NOW)
        assert report.rows_removed > 0 and "every total unchanged" in report.line()
        after_rows = _rows(store)
        # Per run and graph: the last hour at 1 s (a graph is idle one window in five), the hour
        # before by the minute, the oldest hour by ten minutes.
        per_key = 3600 * 4 // 5 + 60 + 6
        with store.engine.connect() as conn:
            counts = conn.execute(select(func.count()).select_from(ReplayWindow)
                                  .group_by(ReplayWindow.run_id, ReplayWindow.descriptor_key)).scalars().all()
        assert counts == [per_key] * 6
        assert after_rows["batch_size_counts"] < before_rows["batch_size_counts"] / 2
        assert _sums(store) | {"replays": None} == before | {"replays": None}
        assert [row[:-3] for row in _sums(store)["replays"]] == [row[:-3] for row in before["replays"]]
        assert [row[-3] for row in _sums(store)["replays"]] == [3600 * 3 * 4 // 5] * 6, "windows held"
        assert _readers(store) == readers

        again = prune(store, POLICY, now=NOW)
        assert again.rows_removed == 0 and _rows(store) == after_rows
        assert again.transactions == 2 * len(POLICY.tiers), "each run and tier starts where it got to"
        assert again.line().startswith("nothing to fold")
    finally:
        store.dispose()


def test_the_rollup_keeps_its_totals_across_folds_and_rebuilds_when_it_must(db_url: str) -> None:
    store = open_store(db_url)
    try:
        _record(store, runs=1)
        queries = _queries(store)
        queries.rollup.refresh()
        readers = _readers(store, queries)
        prune(store, POLICY, now=NOW)
        assert _readers(store, queries) == readers, "folded rows are not counted twice"
        assert _readers(store) == readers, "a rollup built after the fold reads the folded rows whole"

        # Rows it has not read yet, late windows of the oldest hour, are folded before it reads
        # them: the fold says so, and the rollup rebuilds instead of skipping them.
        _record(store, runs=1, start=NOW - HOURS * 3600, seconds=600)
        prune(store, POLICY, now=NOW)
        with store.engine.connect() as conn:
            assert conn.scalar(select(func.max(WindowFold.last_replay_window_id))) > 0
        assert _readers(store, queries) == _readers(store)
    finally:
        store.dispose()


def test_db_prune_folds_and_refuses_a_bad_age(sqlite_url: str) -> None:
    store = open_store(sqlite_url)
    _record(store, runs=1, start=time.time() // 3600 * 3600 - 3 * 3600, seconds=1800)
    before = _sums(store)
    store.dispose()
    program = Program.under_test()
    result = subprocess.run([*program.argv, "db", "prune", "--db", sqlite_url, "--older-than", "1h",
                             "--grain", "10m"], capture_output=True, text=True, timeout=300, env=program.env,
                            cwd=program.cwd)
    assert result.returncode == 0, result.stderr
    assert "folded" in result.stdout and "older than 1h into 10m windows" in result.stdout
    store = open_store(sqlite_url)
    try:
        after = _sums(store)
        assert _rows(store)["replay_windows"] == 3 * 3, "half an hour, three graphs, 10-minute windows"
    finally:
        store.dispose()
    assert [row[:-3] for row in after["replays"]] == [row[:-3] for row in before["replays"]]
    bad = subprocess.run([*program.argv, "db", "prune", "--db", sqlite_url, "--older-than", "soon"],
                         capture_output=True, text=True, timeout=120, env=program.env, cwd=program.cwd)
    assert bad.returncode == 2 and "expected a positive duration" in bad.stderr


def test_the_daemon_folds_on_its_schedule(sqlite_url: str) -> None:
    store = open_store(sqlite_url)
    _record(store, runs=1, start=time.time() // 3600 * 3600 - 3 * 3600, seconds=1800)
    before = _readers(store)
    store.dispose()
    with Daemon(sqlite_url, extra_args=["--retain", "1h:1m", "--prune-every", "1s"]) as daemon:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "graph-inspector retention: folded" not in daemon.output:
            time.sleep(0.2)
        assert "graph-inspector retention: folded" in daemon.output, daemon.output
        assert fetch_rows(sqlite_url, select(func.count()).select_from(ReplayWindow))[0][0] == 30 * 3
    store = open_store(sqlite_url, upgrade=False)
    try:
        assert _readers(store) == before
    finally:
        store.dispose()


def test_a_fleet_hour_written_by_the_minute_is_what_retention_makes_of_its_seconds(tmp_path) -> None:
    """The fleet benchmark writes the older hours of its week as one-minute windows: the rows the
    policy's first tier would have made of the seconds (tests/support/fleet.py)."""
    fleet = Fleet(ranks=2, findings_per_rank=1)
    tables = {}
    for way in ("seconds", "minutes"):
        store = open_store(f"sqlite:///{tmp_path / way}.db")
        try:
            start_fleet(store, fleet, NOW)
            write_hour(store, fleet, NOW, folded_by=None if way == "seconds" else 60)
            if way == "seconds":
                prune(store, Policy((Tier.parse("1m:1m"),)), now=NOW + 3600 + 60)
            with store.engine.connect() as conn:
                tables[way] = {
                    m.__tablename__: sorted(tuple(row)[1:] for row in conn.execute(m.__table__.select()))
                    for m in (ReplayWindow, EagerFallback, BatchSizeCount)
                }
        finally:
            store.dispose()
    assert tables["minutes"] == tables["seconds"]
    assert len(tables["minutes"]["replay_windows"]) == 2 * 60 * fleet.graphs_active


LABELS = ("full tokens=4,reqs=4,uniform=1", "full tokens=8,reqs=8,uniform=1", "eager")
GAP_AT = 3600 + 1830
"""The window whose steps rank 1's recorder dropped (mid-minute, in the second hour): a gap in its
record, 3 steps wide."""


def _record_steps(store: Store) -> list[int]:
    """Two ranks of a job, a flush a second for ``HOURS``: 3 steps a window, their labels changing
    within and across windows; rank 1's record has a gap. The run ids."""
    run_ids = []
    for rank in range(2):
        start = NOW - HOURS * 3600
        with store.writer() as conn:
            info = RunInfo(f"rank {rank}", "node", 100 + rank, "engine", rank, 2, "cpu", "{}", start - 1,
                           job="job")
            run_ids.append(run_id := insert_run(conn, info, start))
            step = 0
            for i in range(HOURS * 3600):
                segment = StepSegment(step)
                for n in range(3):
                    segment.add(LABELS[(i // 2 + n * (rank + 1)) % 3])
                step += 3
                if rank == 1 and i == GAP_AT:
                    continue
                append_steps(conn, run_id, segment, TrafficWindow(start + i, start + i + 1.0))
    return run_ids


def _steps_read(store: Store, run_ids: list[int]) -> list[tuple[int, int, dict[int, str]]]:
    """Every stretch of steps the ranks' check would walk."""
    s = StepSequence
    with store.engine.connect() as conn:
        sequences = {rank: [StepSegment.from_json(first, text) for first, text in conn.execute(
            select(s.first_step, s.sequence).where(s.run_id == run_id).order_by(s.first_step))]
            for rank, run_id in enumerate(run_ids)}
    walked = stretches(sequences, 0, HOURS * 3600 * 3)
    return [(stretch.start, stretch.stop, stretch.labels) for stretch in walked]


def test_step_sequences_fold_into_a_row_per_grain_with_every_step_kept(db_url: str) -> None:
    store = open_store(db_url)
    try:
        run_ids = _record_steps(store)
        before = _steps_read(store, run_ids)
        assert len(before) > HOURS * 3600 and all(len(labels) == 2 for _, _, labels in before)
        report = prune(store, POLICY, now=NOW)
        # Rows removed and made: two hours of seconds into minutes, then the oldest hour's minutes
        # into ten minutes.
        assert report.by_table["step_sequences"] == [2 * 7200 - 1 + 2 * 60, 2 * 120 + 1 + 2 * 6]
        with store.engine.connect() as conn:
            rows = conn.execute(select(StepSequence.run_id, func.count()).group_by(StepSequence.run_id)
                                .order_by(StepSequence.run_id)).all()
        # The last hour a row a second, the hour before a row a minute, the first by ten minutes;
        # rank 1's gap (in the hour before) splits its minute in two.
        assert [count for _, count in rows] == [3600 + 60 + 6, 3600 + 61 + 6]
        assert _steps_read(store, run_ids) == before, "every step of every rank reads the same"
        assert prune(store, POLICY, now=NOW).rows_removed == 0
    finally:
        store.dispose()


# ------------------------------------------------------------ two pruners at once, on PostgreSQL


@contextmanager
def another_writer_at_each_delete(url: str, meddle: Callable[[Store], None]) -> Iterator[list[int]]:
    """Whenever a fold on ``url`` is about to delete the windows it summed, ``meddle`` commits a
    change of those rows through a connection of its own first (as another pruner would); yields
    the count of times it did."""
    other = open_store(url, upgrade=False)
    met: list[int] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if conn.engine.url.database == other.engine.url.database and statement.startswith(
                "DELETE FROM replay_windows") and conn.engine is not other.engine:
            met.append(1)
            meddle(other)

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield met
    finally:
        event.remove(Engine, "before_cursor_execute", before)
        other.dispose()


@pytest.mark.postgres
def test_a_prune_that_meets_another_on_postgresql_tries_again_and_folds_once(
    postgres_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retention, "CONFLICT_BACKOFF_S", 0.0)
    url = postgres_server.new_database()
    store, once = open_store(url), open_store(postgres_server.new_database())
    try:
        _record(store, runs=1, seconds=2 * 3600, start=NOW - 2 * 3600)
        _record(once, runs=1, seconds=2 * 3600, start=NOW - 2 * 3600)
        before = _sums(store)
        prune(once, POLICY, now=NOW)
        conflicts: list[bool] = []
        conflicted = retention._conflicted
        monkeypatch.setattr(retention, "_conflicted", lambda error: conflicts.append(conflicted(error)) or
                            conflicts[-1])
        others: list[retention.FoldReport] = []
        with another_writer_at_each_delete(url, lambda other: others.append(prune(other, POLICY, now=NOW))
                                           if not others else None) as met:
            report = prune(store, POLICY, now=NOW)
        assert met == [1] and others[0].rows_removed > 0, "the other pruner folded that slice first"
        assert conflicts == [True], "this one's fold failed on it, and was tried again"
        assert report.rows_removed == 0 and report.line().startswith("nothing to fold")
        assert _rows(store) == _rows(once), "folded once, as by one pruner"
        assert _sums(store) | {"replays": None} == before | {"replays": None}
    finally:
        store.dispose()
        once.dispose()


@pytest.mark.postgres
def test_db_prune_that_keeps_meeting_another_writer_says_so_in_one_line(
    postgres_server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(retention, "CONFLICT_BACKOFF_S", 0.0)
    url = postgres_server.new_database()
    store = open_store(url)
    try:  # windows of two hours ending an hour ago: `db prune` folds as of now
        _record(store, runs=1, seconds=2 * 3600, start=(time.time() // 3600 - 3) * 3600)
        rows = _rows(store)
    finally:
        store.dispose()

    def touch(other: Store) -> None:
        with other.engine.begin() as conn:
            conn.execute(update(ReplayWindow).values(replays=ReplayWindow.replays))

    with another_writer_at_each_delete(url, touch) as met:
        assert main(["db", "prune", "--older-than", "1h", "--grain", "10m", "--db", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(met) == retention.FOLD_ATTEMPTS
    assert len(err) == 1 and "kept meeting another writer" in err[0] and "run it again" in err[0], err
    check = open_store(url, upgrade=False)
    try:
        assert _rows(check) == rows, "nothing was changed"
    finally:
        check.dispose()
