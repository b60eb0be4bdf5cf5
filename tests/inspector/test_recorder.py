"""The recorder against a real database: counts exact, rows linked, findings de-duplicated."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.engine.interfaces import ExecuteStyle
from workers import FULL, PIECEWISE, capture, drift, fetch_rows

from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher
from capture_core.events import FanOutObserver, NullObserver
from capture_core.sizes import EagerReason
from inspector.errors import DatabaseError
from inspector.recording.recorder import Recorder
from inspector.storage.models import (
    BatchSizeCount,
    EagerFallback,
    EagerTotal,
    Graph,
    ReplayTotal,
    ReplayWindow,
    Run,
    Violation,
)
from inspector.storage.store import open_store


def _scalar(url: str, statement):
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(statement).scalar()
    finally:
        engine.dispose()


def test_replay_windows_sum_to_exactly_what_was_replayed(db_url: str) -> None:
    d4, d8 = BatchDescriptor(4, 4, True), BatchDescriptor(8, None)
    with Recorder(db_url, flush_interval=0.05) as recorder:
        recorder.on_capture(capture(d4))
        recorder.on_capture(capture(d8, mode=PIECEWISE))
        for round_ in range(5):
            for _ in range(100):
                recorder.on_replay(FULL, BatchDescriptor(4, 4, True), 3)
                recorder.on_replay(PIECEWISE, BatchDescriptor(8, None), 5 + round_ % 3)
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 300, PIECEWISE)
            assert recorder.flush(timeout=10)
        run_id = recorder.run_id
    assert recorder.dropped == 0
    windows = fetch_rows(
        db_url,
        select(
            ReplayWindow.mode,
            func.sum(ReplayWindow.replays),
            func.sum(ReplayWindow.num_real_tokens),
            func.sum(ReplayWindow.padding_tokens),
            func.count(),
        )
        .group_by(ReplayWindow.mode)
        .order_by(ReplayWindow.mode),
    )
    real_piecewise = sum(100 * (5 + r % 3) for r in range(5))
    assert [tuple(w[:4]) for w in windows] == [
        ("full", 500, 1500, 500),
        ("piecewise", 500, real_piecewise, 8 * 500 - real_piecewise),
    ]
    assert all(w[4] >= 5 for w in windows), "one window per flush at least"
    totals = fetch_rows(
        db_url,
        select(
            ReplayTotal.mode, ReplayTotal.replays, ReplayTotal.num_real_tokens, ReplayTotal.padding_tokens
        ).order_by(ReplayTotal.mode),
    )
    assert [tuple(t) for t in totals] == [tuple(w[:4]) for w in windows]
    unlinked = _scalar(db_url, select(func.count()).where(ReplayWindow.graph_id.is_(None)))
    assert unlinked == 0
    eager = fetch_rows(
        db_url, select(func.sum(EagerFallback.batches), func.sum(EagerFallback.num_real_tokens))
    )
    assert tuple(eager[0]) == (5, 1500)
    assert tuple(fetch_rows(db_url, select(EagerTotal.reason, EagerTotal.mode, EagerTotal.batches))[0]) == (
        "above_max_capture_size",
        "piecewise",
        5,
    )
    sizes = dict(
        fetch_rows(
            db_url,
            select(BatchSizeCount.num_real_tokens, func.sum(BatchSizeCount.batches)).group_by(
                BatchSizeCount.num_real_tokens
            ),
        )
    )
    assert sizes == {3: 500, 5: 200, 6: 200, 7: 100, 300: 5}
    assert _scalar(db_url, select(Run.ended_at).where(Run.id == run_id)) is not None


def test_run_row_describes_the_process(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = {"mode": "full_and_piecewise", "sizes": [1, 2, 4]}
    with Recorder(db_url, label="nightly", config=config, device="cpu-test") as recorder:
        assert _scalar(db_url, select(Run.backend)) == "unknown"
        recorder.on_capture(capture(BatchDescriptor(2, 2, True)))
        assert recorder.flush(timeout=10)
    run = fetch_rows(
        db_url,
        select(
            Run.label,
            Run.pid,
            Run.rank,
            Run.world_size,
            Run.device,
            Run.backend,
            Run.config,
            Run.host,
            Run.ended_at,
        ),
    )[0]
    assert run.label == "nightly" and run.pid == os.getpid()
    assert (run.rank, run.world_size, run.device, run.backend) == (3, 4, "cpu-test", "eager")
    assert json.loads(run.config) == config
    assert run.host and run.ended_at is not None


def test_captures_and_violations_are_written_without_waiting_for_the_window(db_url: str) -> None:
    descriptor = BatchDescriptor(16, 16, True)
    with Recorder(db_url, flush_interval=3600) as recorder:
        recorder.on_capture(capture(descriptor, address=0xABC000))
        recorder.on_violation(drift(descriptor, actual=0xDEF000))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _scalar(db_url, select(func.count()).select_from(Violation)) == 1:
                break
            time.sleep(0.02)
        columns = (Graph.captured_size, Graph.input_names, Graph.input_addresses, Graph.mode)
        graph = fetch_rows(db_url, select(*columns))[0]
        violation = fetch_rows(
            db_url,
            select(
                Violation.kind,
                Violation.input_name,
                Violation.expected_address,
                Violation.actual_address,
                Violation.descriptor_key,
            ),
        )[0]
    assert tuple(graph) == (16, '["input_ids", "positions"]', json.dumps([0xABC000, 0xABC000 + 4096]), "full")
    assert tuple(violation) == ("address_drift", "input_ids", 0x7F000000, 0xDEF000, descriptor.key)


def test_repeated_violations_bump_one_row(db_url: str) -> None:
    descriptor = BatchDescriptor(4, 4, True)
    with Recorder(db_url, flush_interval=0.05) as recorder:
        for _ in range(7):
            recorder.on_violation(drift(descriptor, actual=0x5000))
        assert recorder.flush(timeout=10)
        for _ in range(5):
            recorder.on_violation(drift(descriptor, actual=0x5000))
        recorder.on_violation(drift(descriptor, actual=0x6000))
        recorder.on_violation(drift(descriptor, actual=0x5000, name="positions"))
    rows = fetch_rows(
        db_url,
        select(
            Violation.input_name,
            Violation.actual_address,
            Violation.count,
            Violation.first_seen_at,
            Violation.last_seen_at,
        ).order_by(Violation.id),
    )
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("input_ids", 0x5000, 12),
        ("input_ids", 0x6000, 1),
        ("positions", 0x5000, 1),
    ]
    assert rows[0].last_seen_at > rows[0].first_seen_at


def test_a_held_replay_cell_counts_what_on_replay_counts(db_url: str) -> None:
    """An engine integration holds the counter of a replay it sees every step and bumps it itself."""
    d4 = BatchDescriptor(4, 4, True)
    with Recorder(db_url, flush_interval=0.05) as recorder:
        recorder.on_capture(capture(d4))
        cell = recorder.replay_cell(FULL, BatchDescriptor(4, 4, True), 3)
        assert cell is not None and recorder.replay_cell(FULL, d4, 3) is cell
        for step in range(300):
            if step % 2:
                cell[0] += 1
            else:
                recorder.on_replay(FULL, d4, 3)
            if step == 150:
                assert recorder.flush(timeout=10)
        run_id = recorder.run_id
    totals = fetch_rows(db_url, select(func.sum(ReplayTotal.replays), func.sum(ReplayTotal.num_real_tokens))
                        .where(ReplayTotal.run_id == run_id))
    assert tuple(totals[0]) == (300, 900)
    with Recorder(db_url, job="a job", rank=0, world_size=2) as ranked:  # the order of steps is kept
        assert ranked.replay_cell(FULL, d4, 3) is None


def test_a_window_of_many_batch_sizes_is_written_in_one_insert_into_sqlite(sqlite_url: str) -> None:
    """A flush writes a table's rows into SQLite as one multi-row INSERT, not as an executemany, which
    Python's sqlite3 runs a row at a time, handing the GIL to the engine's serving thread and taking
    it back at every row (a few hundred times a window on real traffic)."""
    executed: list[int] = []

    def seen(conn, cursor, statement: str, parameters, context, executemany: bool) -> None:
        if statement.startswith("INSERT INTO batch_size_counts"):
            batched = context.execute_style is ExecuteStyle.INSERTMANYVALUES
            executed.append(len(parameters) if executemany and not batched else 1)

    event.listen(Engine, "before_cursor_execute", seen)
    try:
        with Recorder(sqlite_url, flush_interval=3600) as recorder:
            for real in range(1, 301):
                recorder.on_replay(PIECEWISE, BatchDescriptor(512), real)
            assert recorder.flush(timeout=10)
            run_id = recorder.run_id
    finally:
        event.remove(Engine, "before_cursor_execute", seen)
    assert _scalar(sqlite_url, select(func.count()).where(BatchSizeCount.run_id == run_id)) == 300
    assert _scalar(sqlite_url, select(func.sum(BatchSizeCount.num_real_tokens * BatchSizeCount.batches))
                   .where(BatchSizeCount.run_id == run_id)) == sum(range(1, 301))
    assert sum(executed) == 1, executed


def test_flush_thread_loses_no_replay_racing_the_engine(sqlite_url: str) -> None:
    descriptor = BatchDescriptor(8, 8, True)
    recorder = Recorder(sqlite_url, flush_interval=0.001).start()
    stop = threading.Event()
    forced = []

    def flush_hard() -> None:
        while not stop.is_set():
            forced.append(recorder.flush(timeout=10))

    flusher = threading.Thread(target=flush_hard)
    flusher.start()
    emitted = 0
    deadline = time.monotonic() + 120
    # Keep replaying until several windows have been committed while the engine was bumping.
    while (sum(forced) < 5 or emitted < 50_000) and time.monotonic() < deadline:
        for _ in range(1000):
            recorder.on_replay(FULL, descriptor, 8)
        emitted += 1000
    stop.set()
    flusher.join()
    recorder.close()
    assert sum(forced) >= 5, "the flush thread should have written many windows meanwhile"
    windows = _scalar(sqlite_url, select(func.count()).select_from(ReplayWindow))
    assert windows >= 3
    assert _scalar(sqlite_url, select(func.sum(ReplayWindow.replays))) == emitted
    assert _scalar(sqlite_url, select(ReplayTotal.replays)) == emitted


def test_close_is_idempotent_and_flush_after_close_says_false(sqlite_url: str) -> None:
    recorder = Recorder(sqlite_url).start()
    recorder.close()
    recorder.close()
    assert recorder.flush(timeout=0.1) is False
    assert _scalar(sqlite_url, select(func.count()).select_from(Run)) == 1


def test_attach_observes_a_dispatcher_and_keeps_an_existing_observer(sqlite_url: str) -> None:
    plain = CUDAGraphDispatcher(FULL, [1, 2, 4])
    already = CUDAGraphDispatcher(FULL, [1, 2, 4], observer=_Counting())
    recorder = Recorder.attach(plain, already, url=sqlite_url)
    try:
        assert plain.observer is recorder
        assert isinstance(already.observer, FanOutObserver)
        plain.dispatch(100)
        already.dispatch(100)
        assert recorder.flush(timeout=10)
    finally:
        recorder.close()
    assert already.observer.observers[0].eager == 1
    assert _scalar(sqlite_url, select(func.sum(EagerFallback.batches))) == 2


class _Counting(NullObserver):
    def __init__(self) -> None:
        self.eager = 0

    def on_eager(self, reason, num_real_tokens, mode) -> None:
        self.eager += 1


def test_start_refuses_a_malformed_url_or_a_newer_database(sqlite_url: str) -> None:
    with pytest.raises(DatabaseError, match="malformed"):
        Recorder("postgresql+psycopg://user@host:notaport/db").start()
    store = open_store(sqlite_url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    store.dispose()
    with pytest.raises(DatabaseError, match="newer"):
        Recorder(sqlite_url).start()


def test_flush_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="flush_interval"):
        Recorder("sqlite://", flush_interval=0)
